"""The local runtime's seeded fault injector (sdk/local/faults.py): a task meets the same fault in
every run of one seed, whatever order the invocations reach the runtime in, so that
benchmarks/faults.py compares runs on equal terms."""

import random

from stagecoach.local.faults import FaultInjector


def events(iterations: int = 20) -> list[dict]:
    out = []
    for t in range(iterations):
        out += [{"phase": "forward", "t": t, "stage": s, "replica": r} for s in range(2) for r in range(2)]
        out += [{"phase": "backward", "t": t, "stage": s, "replica": r} for s in range(3) for r in range(2)]
        out += [{"phase": "sync", "t": t, "stage": s, "shard": k} for s in range(3) for k in range(2)]
        out += [{"phase": "watch", "t": t, "watch": w} for w in ("forward", "backward")]
    return out


def outcome(inj: FaultInjector, evs: list[dict]) -> dict[str, str | None]:
    """Each invocation's fault by its task and its count so far (the first, a retry, ...)."""
    seen: dict[str, int] = {}
    out = {}
    for ev in evs:
        key = repr(sorted(ev.items()))
        n = seen[key] = seen.get(key, 0) + 1
        f = inj.draw(ev)
        out[f"{key}#{n}"] = None if f is None else f"{f.kind}@{f.delay_s:.6f}"
    return out


SPEC = {"seed": 7, "kill": 0.2, "throttle": 0.05, "hang": 0.02, "delete": 0.02}


def test_a_task_meets_the_same_fault_whatever_order_invocations_arrive_in():
    evs = events() + events(5)  # the first five iterations' tasks twice: retries draw again
    shuffled = evs[:]
    random.Random(1).shuffle(shuffled)
    first = outcome(FaultInjector(**SPEC), evs)
    assert outcome(FaultInjector(**SPEC), shuffled) == first
    assert outcome(FaultInjector(**{**SPEC, "seed": 8}), evs) != first  # the seed matters
    # a retry draws afresh: not every task that met a fault meets it again
    again = [k for k, v in first.items() if k.endswith("#2") and v is not None]
    struck = [k for k, v in first.items() if k.endswith("#1") and v is not None]
    assert struck and len(again) < len(struck)


def test_faults_come_at_their_rates_and_only_a_forward_task_loses_an_activation():
    inj = FaultInjector(**SPEC)
    evs = events(400)
    drawn = [(ev["phase"], inj.draw(ev)) for ev in evs]
    assert 0.17 < inj.counts["kill"] / len(evs) < 0.23
    assert 0.03 < inj.counts["throttle"] / len(evs) < 0.07
    deleted = {phase for phase, f in drawn if f is not None and f.kind == "delete"}
    assert deleted == {"forward"}  # the others write no activation


def test_a_scripted_fault_fires_once_on_the_first_matching_invocation():
    inj = FaultInjector(once=[{"kind": "fail", "phase": "backward", "t": 3, "stage": 1}])
    assert inj.draw({"phase": "backward", "t": 2, "stage": 1, "replica": 0}) is None
    f = inj.draw({"phase": "backward", "t": 3, "stage": 1, "replica": 1})
    assert f is not None and f.kind == "fail"
    assert inj.draw({"phase": "backward", "t": 3, "stage": 1, "replica": 1}) is None
    assert inj.counts["fail"] == 1
