"""The AWS backend: a stack deployed with SAM, found by its outputs; least-privilege IAM; errors that say what to grant."""
