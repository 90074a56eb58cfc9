"""Past 40 workers (issue 25): the planner searches d and stages x d up to the account's
concurrency (planner/limits.py max_stages_at), and the performance model charges the group
executions a Map of more than GROUP_SIZE tasks runs in, and Lambda's scaling rate."""

import pytest
from click.testing import CliRunner

from stagecoach.cli.plan import plan_command
from stagecoach.planner.emit import asl
from stagecoach.planner.limits import (
    GROUP_SIZE,
    GROUP_TRANSITIONS,
    LAMBDA_ACCOUNT_CONCURRENCY,
    MAP_MAX_TASKS,
    concurrency_needed,
    map_transitions,
    max_stages_at,
    scaling_ramp_s,
)
from stagecoach.planner.model.perfmodel import Config, cold_ramp_s, config_terms, evaluate, phase_overhead
from stagecoach.planner.model.platforms import aws_platform
from stagecoach.planner.model.syncmodel import ALL_SYNC, SyncChoice
from stagecoach.planner.plan import Plan
from stagecoach.planner.profile.layers import LayerProfile, ModelProfile
from stagecoach.planner.solve.objective import max_stages_for, objective_value
from stagecoach.planner.solve.search import solve_fixed
from stagecoach.planner.solve.sweep import PlannedConfig, plan_model, replica_candidates

MB = 2**20


def toy(pmb=(20.0, 40.0, 10.0, 30.0)) -> ModelProfile:
    layers = tuple(LayerProfile(f"l{i}", p * MB, 3 * MB, 1 * MB, 1 * MB, (2 + i) * 1e8, (4 + 2 * i) * 1e8) for i, p in enumerate(pmb))
    return ModelProfile("toy", layers, 1 * MB)


def _cfg(S: int, d: int, sync: SyncChoice | None = None) -> Config:
    bal = {1: (4,), 2: (2, 2), 4: (1, 1, 1, 1)}[S]
    return Config(bal, (4096,) * S, d, 1, 2, (sync or SyncChoice("scatter_reduce", d),) * S)


def test_the_account_rule_leaves_a_restarts_headroom_and_caps_one_map():
    assert max_stages_at(64, 1000) == 7  # 7 x 64 = 448 at once, 897 with a restart's
    assert all(
        concurrency_needed(max_stages_at(d, c) * d) <= c < concurrency_needed((max_stages_at(d, c) + 1) * d)
        for d in (1, 3, 64, 250)
        for c in (100, 1000, 5000)
    )
    assert max_stages_at(MAP_MAX_TASKS + 1, 10**6) == 0
    assert max_stages_at(8, 1000, inline_only=True) == 6 and max_stages_at(41, 1000, inline_only=True) == 0  # the rule before groups


def test_plans_beyond_40_workers_are_feasible_up_to_the_accounts_concurrency():
    plat, prof = aws_platform(), toy()
    e = evaluate(prof, _cfg(2, 64), plat)  # refused before groups: 64 > 40 workers in one inline Map
    assert e.feasible, e.violations
    assert max_stages_for(64, 4, 8, plat) == 4 and max_stages_for(128, 4, 8, plat) == 3
    too_many = evaluate(prof, _cfg(4, 128), plat)  # 512 at once needs 1,025 > 1,000
    assert not too_many.feasible and "account's concurrency of 1000" in " ".join(too_many.violations)
    assert evaluate(prof, _cfg(4, 128), plat.replace(concurrency=1025)).feasible
    assert not evaluate(prof, _cfg(2, 64), plat.replace(inline_map_only=True)).feasible


def test_a_grouped_map_pays_its_child_executions_start_and_end_and_their_transitions():
    plat = aws_platform()
    assert phase_overhead(plat, GROUP_SIZE) == pytest.approx(plat.invoke_overhead_s + plat.dispatch_s * (GROUP_SIZE - 1))
    # 100 tasks: groups of 40, 40, 20; the second group's last task starts 1 + 39 dispatches after the first's
    want = plat.invoke_overhead_s + plat.group_start_s + plat.dispatch_s * 40 + plat.group_finish_s
    assert phase_overhead(plat, 100) == pytest.approx(want)
    assert map_transitions(40) == 41 and map_transitions(100) == 101 + 3 * (1 + GROUP_TRANSITIONS)
    prof = toy()
    small, big = evaluate(prof, _cfg(2, 40), plat), evaluate(prof, _cfg(2, 80), plat)
    # five Maps: stage 0's forward (a branch of Forward's Parallel), both stages' backward and sync
    # Maps; beside them the bookkeeping (3) and the two Parallels
    assert small.transitions == 5 + 5 * (1 + 40)
    assert big.transitions == 5 + 5 * (1 + 80 + 2 * (1 + GROUP_TRANSITIONS))
    assert big.time_s > small.time_s + plat.group_start_s + plat.group_finish_s  # on Forward's and BackwardSync's paths


def test_the_models_transitions_are_the_emitted_state_machines():
    plat, prof = aws_platform(), toy()
    tree = SyncChoice("hierarchical", 20)  # 100 replicas in 3 blocks: 20 roots and 60 level-1 aggregators
    for cfg in (_cfg(2, 80), _cfg(4, 64, SyncChoice("k_reduce", 50)), _cfg(1, 100), _cfg(2, 8), _cfg(1, 8), _cfg(2, 100, tree)):
        e = evaluate(prof, cfg, plat)
        assert e.feasible, e.violations
        plan = PlannedConfig(e, (1, 0), "milp", 0.0, prof, plat).to_plan()
        # the phase watchers' states are the cost prediction's (sdk/cost.py), not the planner's
        watchers = asl.watched_phases(plan) * (asl.TRANSITIONS_WATCHED_PHASE + asl.TRANSITIONS_WATCHER)
        assert e.transitions + watchers == asl.transitions_per_iteration(plan)
        assert (watchers > 0) == (cfg.replicas <= 40 and all(plan.sync_tasks(s) <= 40 for s in range(plan.stages)))
        assert [t.sync.tasks for t in config_terms(prof, cfg, plat)] == [plan.sync_tasks(s) for s in range(plan.stages)]


def test_a_sync_map_wider_than_d_counts_in_the_peak_and_the_milp_keeps_it_within_the_account():
    plat, prof = aws_platform(), toy()
    tree = SyncChoice("hierarchical", 40)  # d = 100: 3 blocks, so 40 roots and 120 level-1 aggregators
    e = evaluate(prof, _cfg(2, 100, tree), plat)  # S d = 200 but BackwardSync peaks at 2 x 160 = 320
    assert e.feasible, e.violations
    assert not evaluate(prof, _cfg(2, 100, tree), plat.replace(concurrency=2 * 200 + 1)).feasible
    # a plan of 4 tree stages peaks at 4 x 160 = 640 > 499 (S d = 400 fits): the MILP must not pick it
    wide = evaluate(prof, _cfg(4, 100, tree), plat)
    assert not wide.feasible and "640 Lambda invocations" in " ".join(wide.violations)
    r = solve_fixed(prof, plat, 100, 1, 2, 0, 1, tiers=(4096,), max_stages=4, sync_algos=("hierarchical",))
    assert r.config is not None and evaluate(prof, r.config, plat).feasible


def test_the_milp_prices_a_grouped_plan_as_the_model_does():
    plat, prof = aws_platform(), toy()
    # a sync Map of 64 (in groups: alone, as k-reduce's smaller K would be preferred) and of 8 (none)
    for sync, algos in ((SyncChoice("scatter_reduce", 64), ("scatter_reduce",)), (SyncChoice("k_reduce", 8), ALL_SYNC)):
        cfg = _cfg(2, 64, sync)
        e = evaluate(prof, cfg, plat)
        assert e.feasible, e.violations
        r = solve_fixed(prof, plat, 64, 1, 2, 1, 2**19, tiers=(4096,), max_stages=2, sync_algos=algos, fix=cfg)
        assert r.objective == pytest.approx(objective_value(e.cost, e.time_s, 1, 2**19), rel=1e-6)


def test_a_cold_iteration_pays_lambdas_scaling_rate_beyond_1000_environments_per_function():
    assert scaling_ramp_s(1000) == 0 and scaling_ramp_s(1600) == pytest.approx(6.0)
    plat = aws_platform(concurrency=10_000)
    assert cold_ramp_s(plat, 1600) == 0  # warm state: a function per worker
    assert cold_ramp_s(plat.replace(warm_checkpoint_every=0), 1600) == pytest.approx(6.0)  # one function per stage
    e = evaluate(toy(), Config((4,), (4096,), 1600, 1, 1, (SyncChoice("k_reduce", 40),)), plat.replace(warm_checkpoint_every=0))
    assert e.cold_ramp_s == pytest.approx(6.0)


def test_the_sweep_searches_powers_of_two_the_account_fits():
    plat = aws_platform()
    assert replica_candidates(1024, (1, 2, 4, 8), plat) == (1, 2, 4, 8, 16, 32, 64, 128, 256)  # 256 x 1 stage: 513 <= 1,000
    assert replica_candidates(1024, (1, 2, 4, 8), plat.replace(concurrency=100)) == (1, 2, 4, 8, 16, 32)
    assert replica_candidates(96, (4,), plat) == (1, 2, 4, 8)  # d b must divide G
    assert replica_candidates(1024, (1,), plat.replace(inline_map_only=True)) == (1, 2, 4, 8, 16, 32)
    assert LAMBDA_ACCOUNT_CONCURRENCY == plat.concurrency


def test_plan_model_keeps_every_plan_within_the_concurrency_it_is_given():
    res = plan_model(toy(), 256, aws_platform(), micro_batch_sizes=(4,), max_stages=4, time_limit=10, concurrency=41)
    assert res.platform.concurrency == 41
    assert all(concurrency_needed(c.config.stages * c.config.replicas) <= 41 for c in res.candidates)
    assert any(c.config.stages * c.config.replicas > 16 for c in res.candidates) or res.proven


def test_plan_command_takes_the_accounts_concurrency(tmp_path):
    f = tmp_path / "m.py"
    f.write_text(
        "import torch\nfrom stagecoach import Job\n"
        "job = Job(model=lambda: torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4)),\n"
        "          loss=torch.nn.CrossEntropyLoss(), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),\n"
        "          train=(torch.randn(64, 32), torch.randint(0, 4, (64,))), global_batch=16, iterations=10, name='m')\n"
    )
    js = tmp_path / "plan.json"
    args = [str(f), "--time-limit", "2", "--plot", str(tmp_path / "p.png"), "--json", str(js), "--concurrency", "5"]
    r = CliRunner().invoke(plan_command, args)
    assert r.exit_code == 0, r.output
    assert "account concurrency 5" in r.output
    plan = Plan.from_json(js.read_text())
    assert concurrency_needed(plan.peak_invocations()) <= 5
    bad = CliRunner().invoke(plan_command, [*args[:-1], "2"])
    assert bad.exit_code != 0 and "--concurrency" in bad.output
