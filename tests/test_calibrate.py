"""The local stack's overheads are measured from a real run, and the emulated platform uses them."""

from __future__ import annotations

from stagecoach.calibrate import measure_overheads
from stagecoach.planner.model.perfmodel import phase_overhead
from stagecoach.planner.model.platforms import aws_platform, emulated_platform


def test_overheads_are_read_off_a_real_run_and_feed_the_emulated_platform(backend):
    over = measure_overheads(backend, iterations=6, replicas=3)
    # a phase boundary is state transitions plus a Lambda invocation through moto: it takes time,
    # but far less than a second on a warm stack; consecutive Map items start sooner than that
    assert 0.0 < over.invoke_s < 1.0
    assert 0.0 <= over.dispatch_s < over.invoke_s
    assert 0.0 < over.request_s < 0.5
    assert over.iteration_s >= 0.0
    net = aws_platform()
    plat = emulated_platform(net, **over.to_dict())
    assert plat.invoke_overhead_s == over.invoke_s and plat.iteration_overhead_s == over.iteration_s
    assert plat.storage_latency_s == max(net.storage_latency_s, over.request_s)
    assert plat.speedup(10240) == plat.speedup(128)  # every local worker computes with one thread
    assert phase_overhead(plat, 4) == over.invoke_s + 3 * over.dispatch_s
