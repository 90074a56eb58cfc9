"""The collectives: every algorithm, every d in 1..8 and every K, gives the same bits.

d replicas run as threads, each with its own channel and thread pools, over an in-memory object
store with S3's semantics (tests/memory_s3.py); the end-to-end transparency tests run the same
code through moto. Each replica really computes its gradient (two micro-batches of a small MLP,
with the upload stream armed on the last one, as the backward task does), and after three
iterations every algorithm must have produced exactly the parameters of one optimizer stepping on
the whole stage with the gradients summed in replica order.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

import pytest
import torch
from memory_s3 import MemoryS3
from torch import nn

from stagecoach.core import keys, training
from stagecoach.core.netem import Network, NetworkSpec, share
from stagecoach.core.optim_state import apply_update
from stagecoach.core.training import assign_flat, flat_params, stage_layout
from stagecoach.lambdas import collectives
from stagecoach.lambdas.channel import Channel, ObjectWaitTimeout, Pools
from stagecoach.lambdas.collectives import GradStream, LambdaMLExchange, PipelinedExchange, SyncSpec
from stagecoach.planner import plan
from stagecoach.planner.plan import FUSED_SYNC

JOB = "coll"
MICRO_BATCHES = 2
OPTIMIZERS = {
    "adam": lambda p: torch.optim.Adam(p, lr=0.01),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "sgd": lambda p: torch.optim.SGD(p, lr=0.05),
}


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """Chunks of 4 floats, so even this small stage is cut into many chunks per shard."""
    monkeypatch.setattr(plan, "MIN_CHUNK_BYTES", 16)


def stage(dtype: torch.dtype = torch.float32) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(dtype)


def data(r: int, j: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * r + j)
    return torch.randn(4, 5, generator=g).to(dtype), torch.randn(4, 3, generator=g).to(dtype)


def channel(s3: MemoryS3) -> Channel:
    return Channel(s3, "bucket", net=Network(None), pools=Pools())


def backward(model: nn.Sequential, r: int, d: int, stream: GradStream | None) -> None:
    """Micro-batches in reverse; the stream is armed for the last backward pass, as in phases.py."""
    for j in reversed(range(MICRO_BATCHES)):
        x, y = data(r, j, next(model.parameters()).dtype)
        loss = nn.functional.mse_loss(model(x), y) / (MICRO_BATCHES * d)
        if j == 0 and stream is not None:
            stream.arm()
        loss.backward()
    if stream is not None:
        stream.finish()


def accumulated_like_pytorch(grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The sum plain PyTorch computes: each replica's ``loss.backward()`` accumulates its gradient
    into the parameter's ``.grad`` (AccumulateGrad: the first one stored, each later one added), in
    replica order — here through autograd itself, one backward pass per replica."""
    p = torch.zeros_like(grads[0], requires_grad=True)
    for g in grads:
        (p * g).sum().backward()  # d/dp = 1 * g: exactly g
    assert p.grad is not None
    return p.grad


def reference(d: int, make_opt, iterations: int, dtype: torch.dtype = torch.float32) -> list[torch.Tensor]:
    """One optimizer on the whole flat vector, the replicas' gradients summed as plain PyTorch sums
    them (``accumulated_like_pytorch``), whatever a plan's fan-in."""
    flat = flat_params(stage(dtype).parameters())
    state, out = None, []
    for _ in range(iterations):
        grads = []
        for r in range(d):
            model = stage(dtype)
            assign_flat(list(model.parameters()), flat)
            backward(model, r, d, None)
            grads.append(training.flat_grads(list(model.parameters())))
        flat, state = apply_update(make_opt, flat, accumulated_like_pytorch(grads), state)
        out.append(flat)
    return out


def run_in_threads(fns: list) -> list:
    results: list = [None] * len(fns)
    errors: list = []

    def go(i: int) -> None:
        try:
            results[i] = fns[i]()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=go, args=(i,)) for i in range(len(fns))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    if errors:
        raise errors[0]
    return results


def sync_map(s3: MemoryS3, algo: str, spec: SyncSpec, k: int, fan_in: int) -> None:
    """The stage's sync Map: every task the plan counts, at once, each in the role ``sync_role`` gives it."""
    tasks = plan.Plan(balance=(1,), replicas=spec.replicas, global_batch=spec.replicas, sync=algo, aggregators=k, fan_in=fan_in or 40)

    def task(i: int) -> None:
        ch = channel(s3)
        role = collectives.sync_role(algo, spec, i)
        if isinstance(role, collectives.BlockSum):
            collectives.reduce_block(ch, spec, role.block, role.shard)
        else:
            collectives.reduce_shard(ch, spec, role.shard, inputs=role.inputs)
        ch.settle()

    run_in_threads([lambda i=i: task(i) for i in range(tasks.sync_tasks(0))])


def distributed(
    algo: str, d: int, k: int, make_opt, iterations: int, fan_in: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[list[torch.Tensor], MemoryS3]:
    """Run the algorithm for ``iterations`` (with the plan's ``fan_in``: a hierarchical stage's
    blocks; 0 = the default); returns the gathered parameters after each."""
    s3 = MemoryS3()
    p0 = flat_params(stage(dtype).parameters())
    layout = stage_layout(p0.numel(), p0.element_size(), k, d)
    for kk, chunks in enumerate(layout):
        for c, (a, b) in enumerate(chunks):
            channel(s3).put_tensors(keys.params(JOB, 0, 0, kk, c), {"p": p0[a:b]})
    flat, out = p0, []
    for t in range(iterations):
        spec = SyncSpec(JOB, 0, t, d, layout, make_opt, window_start=0, deadline=time.time() + 30, fan_in=fan_in)

        def replica(r: int, flat=flat, spec=spec):
            ch = channel(s3)
            model = stage(dtype)
            params = list(model.parameters())
            assign_flat(params, flat)
            if d == 1:
                grads: dict = {}
                state = collectives.prefetch_state(ch, spec, 0)
                stream = GradStream(params, layout, collectives.write_order(spec), lambda k_, c, g: grads.__setitem__((k_, c), g))
                backward(model, r, d, stream)
                new = collectives.update_alone(ch, spec, flat, torch.cat([grads[0, c] for c in spec.chunks(0)]), state)
            elif algo in FUSED_SYNC:
                ex = collectives.EXCHANGES[algo](ch, spec, r)
                backward(model, r, d, ex.stream(params))
                new = ex.finish(flat)
            else:
                backward(model, r, d, GradStream(params, layout, collectives.write_order(spec), collectives.gradient_writer(ch, spec, r)))
                new = None
            ch.settle()
            return new

        held = run_in_threads([lambda r=r: replica(r) for r in range(d)])
        if d > 1 and algo not in FUSED_SYNC:
            sync_map(s3, algo, spec, k, fan_in)
        flat = collectives.gather(channel(s3), spec, t + 1)
        for h in held:  # what a replica holds after a fused sync is what everyone else reads
            if h is not None:
                assert torch.equal(h, flat)
        out.append(flat)
    return out, s3


def cases():
    for d in range(1, 9):
        if d == 1:
            yield "scatter_reduce", 1, 1
            continue
        yield "scatter_reduce", d, d
        yield "pipelined_scatter_reduce", d, d
        yield "lambdaml_scatter_reduce", d, d
        yield "all_reduce", d, 1
        for k in range(2, d):
            yield "k_reduce", d, k


@pytest.mark.parametrize("algo,d,k", list(cases()), ids=lambda v: str(v))
def test_every_algorithm_gives_the_bits_of_one_optimizer_on_the_summed_gradient(algo, d, k):
    make_opt = OPTIMIZERS["adam"]
    got, s3 = distributed(algo, d, k, make_opt, iterations=3)
    want = reference(d, make_opt, iterations=3)
    for t in range(3):
        assert torch.equal(got[t], want[t]), f"iteration {t}: max diff {(got[t] - want[t]).abs().max()}"
    assert not torch.equal(got[-1], flat_params(stage().parameters())), "the parameters must have moved"
    # version 1 is neither the window's checkpoint (0) nor still read (the last update wrote 3)
    assert not s3.keys(f"jobs/{JOB}/params/v1/") and not s3.keys(f"jobs/{JOB}/optim/v1/")
    assert s3.keys(f"jobs/{JOB}/params/v0/") and s3.keys(f"jobs/{JOB}/params/v3/") and s3.keys(f"jobs/{JOB}/optim/v3/")


@pytest.mark.parametrize("opt", ["sgd-momentum", "sgd"])
def test_stateful_and_stateless_optimizers(opt):
    got, s3 = distributed("pipelined_scatter_reduce", 3, 3, OPTIMIZERS[opt], iterations=2)
    want = reference(3, OPTIMIZERS[opt], iterations=2)
    assert torch.equal(got[-1], want[-1])
    assert bool(s3.keys(f"jobs/{JOB}/optim/")) == (opt != "sgd"), "plain SGD has no state to store"


def test_algorithms_agree_with_each_other_bit_for_bit():
    make_opt = OPTIMIZERS["sgd-momentum"]
    results = {
        (a, k): distributed(a, 4, k, make_opt, iterations=3)[0][-1]
        for a, k in [
            ("scatter_reduce", 4),
            ("pipelined_scatter_reduce", 4),
            ("lambdaml_scatter_reduce", 4),
            ("all_reduce", 1),
            ("k_reduce", 2),
            ("k_reduce", 3),
        ]
    }
    first = next(iter(results.values()))
    for key, v in results.items():
        assert torch.equal(v, first), key


def test_layout_covers_the_vector_in_order():
    for numel in (1, 5, 66, 1000):
        for d in range(1, 9):
            for k in range(1, d + 1):
                layout = stage_layout(numel, 4, k, d)
                flat = [rng for shard in layout for rng in shard]
                assert flat[0][0] == 0 and flat[-1][1] == numel
                assert all(a[1] == b[0] for a, b in zip(flat, flat[1:]))
                assert len(layout) == k


def test_grad_stream_emits_top_chunks_while_lower_layers_still_compute():
    model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 2))
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    layout = stage_layout(numel, 4, 4, 4)
    order = [(k, c) for k in range(4) for c in range(len(layout[k]))]
    emitted: list[tuple[int, int]] = []
    seen_when_first_layer_done: list[int] = []
    stream = GradStream(params, layout, order, lambda k, c, g: emitted.append((k, c)))
    # the first layer's weight is the last gradient backward produces
    params[0].register_post_accumulate_grad_hook(lambda p: seen_when_first_layer_done.append(len(emitted)))
    x = torch.randn(3, 6)
    stream.arm()
    model(x).pow(2).sum().backward()
    stream.finish()
    assert seen_when_first_layer_done[0] > 0, "chunks of the top layers must leave before the bottom layer is done"
    assert sorted(emitted) == sorted(order) and len(emitted) == len(order)
    flat = torch.cat([stream.chunk(key) for key in order])
    assert torch.equal(flat, training.flat_grads(params))


def test_pipelined_exchange_refuses_a_k_other_than_d():
    spec = SyncSpec(JOB, 0, 0, 4, stage_layout(66, 4, 2, 4), OPTIMIZERS["sgd"], 0, time.time() + 5)
    with pytest.raises(ValueError, match="K = d"):
        PipelinedExchange(channel(MemoryS3()), spec, 0)


@pytest.mark.parametrize("algo", ["pipelined_scatter_reduce", "lambdaml_scatter_reduce"])
def test_lambdamls_exchange_starts_after_the_backward_pass_and_the_pipelined_one_during_it(algo):
    """LambdaML's phases begin when the backward pass has ended: nothing of the gradient is in S3
    before ``finish``; FuncPipe's pipelined exchange has sent chunks of the d-1 others' shards by then."""
    d, s3 = 2, MemoryS3()
    p0 = flat_params(stage().parameters())
    layout = stage_layout(p0.numel(), p0.element_size(), d, d)
    spec = SyncSpec(JOB, 0, 0, d, layout, OPTIMIZERS["sgd"], 0, time.time() + 30)
    ch = channel(s3)
    ex = collectives.EXCHANGES[algo](ch, spec, 0)
    assert isinstance(ex, LambdaMLExchange) == (algo == "lambdaml_scatter_reduce")
    model = stage()
    backward(model, 0, d, ex.stream(list(model.parameters())))
    prefix = keys.gshard(JOB, 0, 0, 0, 0, 0).split("/s0/")[0] + "/"  # replica 0's gradient shards
    if algo == "lambdaml_scatter_reduce":
        assert not ch._pending and not s3.keys(prefix), "no request may start before the backward pass has ended"
    else:
        end = time.time() + 10
        groups = collectives.send_groups(algo, d, layout, 0)  # shard 1's chunks, merged (keys.gsend)
        while len(s3.keys(prefix)) < len(groups) and time.time() < end:  # the uploads started during it land
            time.sleep(0.01)
        sent = s3.keys(prefix)
        assert sum(map(len, groups)) == len(layout[1]) and sent == sorted(keys.gsend(JOB, 0, 0, 0, g) for g in range(len(groups)))
    ch.settle(failed=True)


def test_a_shared_link_gives_concurrent_transfers_fair_shares():
    # 100 B and 300 B start together on a 100 B/s link: 50 B/s each until the first is done at
    # 2 s, then the second has the link alone and ends at 4 s
    rem = {"a": 100.0, "b": 300.0}
    share(rem, 1.0, 100.0)
    assert rem == {"a": 50.0, "b": 250.0}
    share(rem, 1.5, 100.0)  # the first finishes at +1 s, its share goes to the second at once
    assert rem["a"] == 0.0 and rem["b"] == pytest.approx(150.0)
    share(rem, 10.0, 100.0)
    assert rem == {"a": 0.0, "b": 0.0}


class RecordingNetwork:
    """Stands in for the emulated links and records what the channel asks of them."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.spec = NetworkSpec(1.0, 1.0, 0.5)
        outer = self

        class L:
            def __init__(self, name: str) -> None:
                self.name = name

            def transfer(self, n: int) -> None:
                outer.calls.append((self.name, n))

        self.up, self.down = L("up"), L("down")

    def latency(self, spent: float = 0.0) -> None:
        self.calls.append(("latency",))

    def expected_put_s(self, n: int) -> float:
        return 0.0

    def observed_put(self, n: int, s: float) -> None:
        pass


def test_channel_pays_the_emulated_link_per_direction_and_publishes_after_it():
    s3 = MemoryS3()
    net = RecordingNetwork()
    ch = Channel(s3, "bucket", net=net, pools=Pools())
    seen_at_put: list[bool] = []
    net.up.transfer = lambda n, f=net.up.transfer: (seen_at_put.append("a" in s3.objects), f(n))[1]
    ch.put_bytes("a", b"x" * 1000)
    assert net.calls == [("up", 1000), ("latency",)] and seen_at_put == [False], "visible only after its transfer"
    net.calls.clear()
    assert ch.get_bytes("a") == b"x" * 1000
    assert net.calls == [("latency",), ("down", 1000)]
    net.calls.clear()
    assert ch.get_bytes("missing") is None
    assert net.calls == [("latency",)], "a 404 costs its round trip, no bytes"


def test_network_spec_from_the_environment_is_checked():
    assert NetworkSpec.from_env(NetworkSpec(70e6, 70e6, 0.03).to_env()) == NetworkSpec(70e6, 70e6, 0.03)
    for bad in ("nope", '{"up_Bps": 1}', '{"up_Bps": -1, "down_Bps": 1}'):
        with pytest.raises(ValueError, match="STAGECOACH_NETWORK"):
            NetworkSpec.from_env(bad)


class SlowS3(MemoryS3):
    def put_object(self, **kw):  # each PUT takes 0.2 s
        time.sleep(0.2)
        return super().put_object(**kw)


def test_concurrent_transfers_are_counted_once_in_the_task_time():
    ch = channel(SlowS3())
    t0 = time.perf_counter()
    for i in range(4):  # four uploads in flight at once
        ch.submit_put(f"k{i}", {"x": torch.zeros(3)})
    ch.settle()
    wall = time.perf_counter() - t0
    st = ch.stats.as_dict()
    assert st["puts"] == 4 and st["bytes_up"] > 0
    assert st["upload_s"] <= wall + 0.01 and st["transfer_s"] == pytest.approx(st["upload_s"])
    assert st["upload_s"] < 0.6, "four overlapping 0.2 s uploads occupy ~0.2 s of the task, not 0.8 s"


def test_submit_window_keeps_at_most_window_requests_in_flight_in_order():
    """The sync task's downloads go out in chunk order, a bounded number at a time, so the first
    chunks arrive first instead of everything arriving together at the end."""
    from concurrent.futures import ThreadPoolExecutor

    ch = channel(MemoryS3())
    lock = threading.Lock()
    running, peak, started = [0], [0], []
    pool = ThreadPoolExecutor(8)

    def work(i: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
            started.append(i)
        time.sleep(0.01)
        with lock:
            running[0] -= 1
        return i * i

    calls = [lambda i=i: pool.submit(work, i) for i in range(12)]
    futures = ch.submit_window(calls, window=3)
    assert [f.result(timeout=10) for f in futures] == [i * i for i in range(12)]
    assert peak[0] == 3
    assert started[:3] == [0, 1, 2] and sorted(started) == list(range(12))


def test_submit_window_fails_the_rest_once_the_task_has_failed():
    from concurrent.futures import ThreadPoolExecutor

    ch = channel(MemoryS3())
    pool = ThreadPoolExecutor(2)
    gate = threading.Event()
    calls = [lambda: pool.submit(gate.wait, 5)] + [lambda: pool.submit(lambda: "late") for _ in range(4)]
    futures = ch.submit_window(calls, window=1)
    ch._aborted.set()  # what Channel.settle(failed=True) does
    gate.set()
    assert futures[0].result(timeout=5) is True
    for f in futures[1:]:
        with pytest.raises(ObjectWaitTimeout):
            f.result(timeout=5)


def test_the_pipelined_exchange_queues_its_gather_only_once_it_has_updated_a_chunk():
    """The peers' updated chunks cannot exist before this replica's first one: a wait started at
    the exchange's start would only poll (each poll a GET)."""
    d, s3 = 2, MemoryS3()
    p0 = flat_params(stage().parameters())
    layout = stage_layout(p0.numel(), p0.element_size(), d, d)
    for kk, chunks in enumerate(layout):
        for c, (a, b) in enumerate(chunks):
            channel(s3).put_tensors(keys.params(JOB, 0, 0, kk, c), {"p": p0[a:b]})
    spec = SyncSpec(JOB, 0, 0, d, layout, OPTIMIZERS["sgd"], 0, time.time() + 30)
    exchanges = [PipelinedExchange(channel(s3), spec, r) for r in range(d)]
    models = [stage() for _ in range(d)]
    for r in range(d):
        backward(models[r], r, d, exchanges[r].stream(list(models[r].parameters())))
    assert all(ex.incoming and not ex.gathered for ex in exchanges)  # the exchange's own downloads only
    got = run_in_threads([lambda ex=ex: ex.finish(p0) for ex in exchanges])
    assert all(ex.gathered for ex in exchanges) and torch.equal(got[0], got[1])
    for ex in exchanges:
        ex.ch.settle()


# -- the reduction is plain PyTorch's left fold at every d, whatever the fan-in ---------------------------
ALL_ALGORITHMS = ["scatter_reduce", "k_reduce", "all_reduce", "hierarchical", "pipelined_scatter_reduce", "lambdaml_scatter_reduce"]


def blocked_sum(grads: Sequence[torch.Tensor], f: int) -> torch.Tensor:
    """The order every algorithm used to sum in at d > f: the left fold of the left folds of blocks
    of f consecutive replicas (not what PyTorch computes)."""
    return collectives.left_fold([collectives.left_fold(grads[i : i + f]) for i in range(0, len(grads), f)])


def spread_gradients(d: int, n: int, dtype: torch.dtype) -> list[torch.Tensor]:
    """d gradients whose sum's rounding depends on the order: magnitudes from 1e-4 to 1e4, both
    signs, and in element 0 the float32 trap 1e8, 1, -1e8, 1, 1, ... (1e8 + 1 rounds to 1e8: the
    plain left fold keeps the later ones, blocks of 2 lose both of the first block)."""
    g = torch.Generator().manual_seed(d)
    out = []
    for r in range(d):
        x = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-4, 5, (n,), generator=g)
        x[0] = (1e8, 1.0, -1e8)[r] if r < 3 else 1.0
        out.append(x.to(dtype))
    return out


def summed_by(algo: str, d: int, k: int, fan_in: int, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """The gradient sum the sync of ``algo`` applies, through the real collectives (the backward
    tasks' streams, the sync Map's roles, the exchanges): each replica's parameter gets
    ``grads[r]`` as its .grad, then one SGD step with lr 1 from zero parameters, so the gathered
    version 1 is exactly minus the sum."""
    s3, n, dtype = MemoryS3(), grads[0].numel(), grads[0].dtype
    p0 = torch.zeros(n, dtype=dtype)
    layout = stage_layout(n, p0.element_size(), k, d)
    for kk, chunks in enumerate(layout):
        for c, (a, b) in enumerate(chunks):
            channel(s3).put_tensors(keys.params(JOB, 0, 0, kk, c), {"p": p0[a:b]})
    spec = SyncSpec(JOB, 0, 0, d, layout, lambda p: torch.optim.SGD(p, lr=1.0), 0, time.time() + 30, fan_in=fan_in)

    def replica(r: int) -> None:
        ch = channel(s3)
        params = [nn.Parameter(p0.clone())]
        params[0].grad = grads[r].clone()
        if algo in FUSED_SYNC:
            ex = collectives.EXCHANGES[algo](ch, spec, r)
            ex.stream(params).finish()
            ex.finish(p0)
        else:
            GradStream(params, layout, collectives.write_order(spec), collectives.gradient_writer(ch, spec, r)).finish()
        ch.settle()

    run_in_threads([lambda r=r: replica(r) for r in range(d)])
    if algo not in FUSED_SYNC:
        sync_map(s3, algo, spec, k, fan_in)
    return -collectives.gather(channel(s3), spec, 1)


def k_values(algo: str, d: int) -> list[int]:
    return {"k_reduce": [2], "all_reduce": [1], "hierarchical": [1, 2, d]}.get(algo, [d])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
@pytest.mark.parametrize("d,fan_in", [(3, 2), (5, 2), (5, 3), (7, 2), (7, 3)])
@pytest.mark.parametrize("algo", ALL_ALGORITHMS)
def test_every_algorithm_sums_like_pytorch_at_d_above_the_fan_in(algo, d, fan_in, dtype):
    """At d > fan_in every algorithm (the hierarchical chain included, several chunks per shard)
    applies exactly PyTorch's accumulated .grad, g_0 + g_1 + ... + g_{d-1} left to right, and not
    the blocked sum, which differs from it on these gradients (at d = f + 1 the two coincide)."""
    grads = spread_gradients(d, 64, dtype)
    want = accumulated_like_pytorch(grads)
    assert torch.equal(want, collectives.left_fold(grads))
    assert d == fan_in + 1 or not torch.equal(blocked_sum(grads, fan_in), want), "the gradients must tell the orders apart"
    for k in k_values(algo, d):
        got = summed_by(algo, d, k, fan_in, grads)
        assert got.dtype == dtype
        assert torch.equal(got, want), f"{algo} K={k}: {(got != want).sum()} elements differ, max {(got - want).abs().max()}"
