"""``trtkv bench``: a small sweep of two engines on the tiny model writes every artifact with sane values."""
from __future__ import annotations

import csv
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from cli_helpers import assert_one_line_error

from trtkv.bench import parse_batch_sizes, parse_size
from trtkv.errors import TrtkvError

PLOTS = ("latency_vs_batch.png", "throughput_vs_batch.png", "kv_vs_tokens.png")


def test_parse_size_and_batches():
    assert parse_size("2GiB") == 2 * 2**30
    assert parse_size("1.5 GB") == 1_500_000_000
    assert parse_size("4096") == 4096
    assert parse_batch_sizes("1, 8,32,8") == (1, 8, 32)
    for bad in ("2 lightyears", "", "-1GiB"):
        with pytest.raises(TrtkvError):
            parse_size(bad)
    for bad in ("1,x", "0,2", ""):
        with pytest.raises(TrtkvError):
            parse_batch_sizes(bad)


@pytest.mark.model
def test_bench_two_engines(tiny_ckpt, engine_factory, tmp_path):
    from trtkv.cli import main

    full = engine_factory(tiny_ckpt, "full")
    sl = engine_factory(tiny_ckpt, "streamingllm", budget=16)
    out = tmp_path / "bench"
    r = CliRunner().invoke(main, ["bench", str(full), str(sl), "--batch-sizes", "1,2", "--prompt-len", "24",
                                  "--gen-len", "12", "--kv-memory", "1MiB", "--repeat", "2", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "largest batch that fits" in r.output and "method:" in r.output

    doc = json.loads((out / "results.json").read_text())
    assert [e["policy"] for e in doc["engines"]] == ["full", "streamingllm"]
    assert doc["synthetic_weights"] is False and doc["config"]["kv_memory"] == 2**20
    rows = {(x["engine"], x["batch"]): x for x in doc["results"]}
    assert len(rows) == 4 and len(doc["runs"]) == 8  # 2 engines x 2 batch sizes x 2 repeats
    names = [e["label"] for e in doc["engines"]]
    for (name, b), x in rows.items():
        assert x["output_tokens"] == b * 12  # ignore_eos: exactly gen_len tokens per request
        assert x["max_concurrent"] == b
        assert 0 < x["tpot_ms_p50"] <= x["tpot_ms_p90"] <= x["tpot_ms_p99"]
        assert x["prefill_s_per_request"] > 0 and x["e2e_s"] > 0 and x["tokens_per_s"] > 0
        assert x["bandwidth_gb_s"] > 0
        assert x["kv_bytes_per_request_end"] <= x["kv_bytes_per_request_peak"]
        assert x["kv_bytes_total_peak"] >= x["kv_bytes_per_request_end"] * b * 0.99
        assert x["kv_pool_bytes"] >= x["kv_pool_peak_bytes"] >= x["kv_bytes_total_peak"] * 0.5
        assert x["ratios_to_first"]["tokens_per_s"] > 0
    for b in (1, 2):
        assert rows[(names[0], b)]["ratios_to_first"]["tokens_per_s"] == 1.0
        # the window of 16 tokens holds less than 36 tokens of the full cache, and evicts
        assert rows[(names[1], b)]["kv_bytes_per_request_peak"] < rows[(names[0], b)]["kv_bytes_per_request_peak"]
        assert rows[(names[1], b)]["evicted_tokens"] > 0 and rows[(names[0], b)]["evicted_tokens"] == 0
    for name, fit in doc["max_batch_fit"].items():
        assert fit["max_batch"] == 2**20 // fit["per_request_peak_kv_bytes"]
    assert doc["max_batch_fit"][names[1]]["max_batch"] > doc["max_batch_fit"][names[0]]["max_batch"]

    trace = doc["kv_trace"][names[0]]
    assert trace["generated_tokens"][0] == 1 and trace["generated_tokens"][-1] == 12
    assert trace["kv_bytes"] == sorted(trace["kv_bytes"])  # the full cache only grows
    assert max(doc["kv_trace"][names[1]]["kv_bytes"]) <= max(trace["kv_bytes"])

    with open(out / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert len(csv_rows) == 4 and "tpot_ms_p99" in csv_rows[0] and "ratio_tokens_per_s" in csv_rows[0]
    for name in PLOTS:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5000, name


def test_bench_bad_input(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "trtkv.cli", "bench", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=120)
    assert_one_line_error(run(str(tmp_path / "missing")), "no engine at")
    assert_one_line_error(run(str(tmp_path), "--kv-memory", "lots"), "cannot read the size")


@pytest.mark.model
def test_load_engines_overrides_and_shared_weights(tiny_ckpt, engine_factory):
    from trtkv.bench import load_engines

    full = engine_factory(tiny_ckpt, "full")
    sl = engine_factory(tiny_ckpt, "streamingllm", budget=16)
    a, b = load_engines([full, sl], policy_overrides={"n_sink": "2"})
    assert b.engine.policy.n_sink == 2 and "n_sink" not in a.engine.policy.params()
    # one copy of identical weights (and of their oneDNN-packed copy, when the runtime packs them)
    assert a.engine.model is b.engine.model and a.engine.core.model is b.engine.core.model
    assert getattr(b.engine.core.model, "_model", b.engine.core.model) is b.engine.model
    assert a.label != b.label
    with pytest.raises(TrtkvError, match="--set bogus"):
        load_engines([full, sl], policy_overrides={"bogus": "1"})


@pytest.mark.model
def test_bench_reports_thinkv_stats(tiny_ckpt, engine_factory, tmp_path):
    """ThinKV's bits, thought shares and eviction call rate reach results.json, the CSV and the table."""
    from trtkv.cli import main

    full = engine_factory(tiny_ckpt, "full")
    tk = engine_factory(tiny_ckpt, "thinkv", budget=16, tau=8, group=4, retention="4", thought_schedule="RTE")
    out = tmp_path / "bench"
    r = CliRunner().invoke(main, ["bench", str(full), str(tk), "--batch-sizes", "2", "--prompt-len", "16",
                                  "--gen-len", "40", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "thinkv (mean per request)" in r.output
    rows = {x["policy"]: x for x in json.loads((out / "results.json").read_text())["results"]}
    assert rows["full"]["policy_stats"] == {}
    st = rows["thinkv"]["policy_stats"]
    shares = [st[f"thinkv.thought_shares.{c}"] for c in "RET"]
    assert sum(shares) == pytest.approx(1.0, abs=1e-3) and min(shares) > 0  # RTE schedule: all three occur
    assert 2 < st["thinkv.avg_element_bits"] < 16
    assert 0 < st["thinkv.eviction_call_rate"] <= 1 and st["thinkv.segments"] == 5
    with open(out / "results.csv") as f:
        csv_rows = list(csv.DictReader(f))
    assert "policy.thinkv.eviction_call_rate" in csv_rows[0]


def test_progress_bar_logs_lines_when_not_a_terminal(capsys):
    """Under nohup / a log file a long sweep must still say where it is: whole lines, not \\r redraws."""
    from trtkv.progress import progress_bar

    bar = progress_bar(10, "fidelity", "tok", None, log_interval_s=0)
    for _ in range(10):
        bar.update(1)
    bar.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert len(lines) >= 2 and all(ln.startswith("fidelity") for ln in lines)
    assert "10/10" in lines[-1]

    quiet = progress_bar(10, "bench", "step", False)
    quiet.update(10)
    quiet.close()
    assert capsys.readouterr().err == ""


@pytest.mark.model
def test_bench_profile_splits_every_decode_step(tiny_ckpt, engine_factory, tmp_path):
    """--profile: every decode step splits into model, attention, kv_write, policy and bookkeeping time, none
    negative, adding up to the measured step; the policy's hooks (ThinKV) and the kv_write kernel show up."""
    from trtkv.cli import main
    from trtkv.runtime.observers import PROFILE_PHASES

    full = engine_factory(tiny_ckpt, "full")
    tk = engine_factory(tiny_ckpt, "thinkv", budget=16, tau=8, group=4, retention="4", thought_schedule="RTE")
    out = tmp_path / "bench"
    r = CliRunner().invoke(main, ["bench", str(full), str(tk), "--batch-sizes", "3", "--prompt-len", "12",
                                  "--gen-len", "20", "--profile", "--no-warmup", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "decode step profile" in r.output
    doc = json.loads((out / "results.json").read_text())
    for run in doc["runs"]:
        parts = run["profile_s"]
        assert set(parts) == set(PROFILE_PHASES)
        assert all(len(parts[p]) == len(run["decode_s"]) for p in PROFILE_PHASES)
        for i, step in enumerate(run["decode_s"]):
            assert all(parts[p][i] >= 0 for p in PROFILE_PHASES)
            assert sum(parts[p][i] for p in PROFILE_PHASES) == pytest.approx(step, rel=1e-9, abs=1e-12)
    rows = {x["policy"]: x for x in doc["results"]}
    for row in rows.values():
        ms = row["profile_ms"]
        assert sum(ms.values()) == pytest.approx(row["step_ms_mean"], rel=1e-9)
        assert ms["model"] > 0 and ms["attention"] > 0 and ms["kv_write"] > 0
        assert row["engine_overhead_ms"] == pytest.approx(ms["kv_write"] + ms["policy"] + ms["bookkeeping"])
    assert rows["thinkv"]["profile_ms"]["policy"] > rows["full"]["profile_ms"]["policy"]  # k-means anneals
    assert rows["full"]["ratios_to_first"]["engine_overhead_ms"] == 1.0
    with open(out / "results.csv") as f:
        assert "profile_attention_ms" in next(csv.DictReader(f))


@pytest.mark.model
def test_profile_clock_is_off_unless_observed(tiny_ckpt, engine_factory, load_engine):
    """Without a profiling observer the core and cache hold no clock; attaching StepProfiler sets one on both
    and a decode step then fills every phase; detaching removes it."""
    from trtkv.runtime.observers import PROFILE_PHASES, StepProfiler
    from trtkv.runtime.request import Request
    from trtkv.runtime.sampling import SamplingParams, make_generator
    from trtkv.runtime.scheduler import Scheduler

    eng = load_engine(engine_factory(tiny_ckpt, "full"))
    core = eng.make_core()
    assert core.clock is None and core.cache.clock is None
    prof = StepProfiler()
    core.attach(prof)
    assert core.clock is prof.clock and core.cache.clock is prof.clock
    with pytest.raises(ValueError, match="at most one"):
        core.attach(StepProfiler())
    assert core.observers == (prof,)
    req = Request(1, "", list(range(5, 17)), SamplingParams(max_tokens=3, ignore_eos=True, chat=False).validate(2048),
                  make_generator(0), 2048)
    sched = Scheduler(core, 4)
    sched.add(req)
    sched.step()  # prefill + first decode step
    parts = prof.clock.take()
    assert set(parts) == set(PROFILE_PHASES) and parts["model"] > 0 and parts["attention"] > 0
    assert not prof.clock.running
    core.detach(prof)
    assert core.clock is None and core.cache.clock is None
    while not req.result:
        sched.step()


@pytest.mark.model
def test_memory_limited_run_admits_what_the_memory_holds(tiny_ckpt, engine_factory, tmp_path):
    """``--requests auto --kv-memory``: each engine's pools get the memory; twice its largest batch is queued, at
    most that batch decodes at once (continuous batching fills it back as requests finish), every request
    finishes, and the cheaper policy runs a bigger batch."""
    import dataclasses

    from trtkv.api import Engine
    from trtkv.bench.capacity import largest_batch
    from trtkv.cache.budget import pages_needed, plan_pools
    from trtkv.cli import main

    full = engine_factory(tiny_ckpt, "full")
    sl = engine_factory(tiny_ckpt, "streamingllm", budget=16)
    kv, P, G = 96 * 1024, 24, 40
    caps = []
    for path in (full, sl):
        e = Engine.load(path)
        cfg = dataclasses.replace(e.core.cache.cfg, kv_memory=kv)
        cap = largest_batch(e.policy, cfg, P, G)
        need = pages_needed(e.policy, cfg, P, G)
        for b, fits in ((cap.batch, True), (cap.batch + 1, False)):  # the largest batch, not one more
            pages = plan_pools(dataclasses.replace(cfg, max_batch=b), e.policy.pool_formats(),
                               e.policy.drops_tokens()).pages
            assert all(b * n <= pages for n in need.values()) == fits
        caps.append(cap.batch)
    assert 1 <= caps[0] < caps[1]

    out = tmp_path / "bench"
    r = CliRunner().invoke(main, ["bench", str(full), str(sl), "--requests", "auto", "--kv-memory", "96KiB",
                                  "--prompt-len", str(P), "--gen-len", str(G), "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "throughput at 96.00 KiB of KV memory" in r.output
    doc = json.loads((out / "results.json").read_text())
    rows = [x for x in doc["results"]]
    assert [x["admission_batch"] for x in rows] == caps
    for x, cap in zip(rows, caps):
        assert x["requests"] == x["batch"] == 2 * cap
        assert x["output_tokens"] == 2 * cap * G  # every queued request finished, exactly G tokens each
        assert x["max_concurrent"] == cap  # the memory's batch was reached and never exceeded
        assert x["kv_pool_bytes"] <= kv
        assert x["steady_tokens_per_s"] > 0 and 0 < x["kv_footprint_pct"]
    run = next(r for r in doc["runs"] if r["engine"] == rows[1]["engine"])
    assert max(run["step_waiting"]) > 0 and run["step_waiting"][-1] == 0  # requests waited, then all ran
    assert rows[1]["kv_footprint_pct"] < rows[0]["kv_footprint_pct"]
    data = (out / "throughput_at_memory_limit.png").read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.model
def test_memory_limited_run_cut_by_duration(tiny_ckpt, engine_factory, tmp_path):
    """``--duration``: the run stops at the first step past it; the requests running then are finished short
    (their pages freed), the waiting ones never run, and the table says how many finished."""
    from trtkv.cli import main

    sl = engine_factory(tiny_ckpt, "streamingllm", budget=16)
    out = tmp_path / "bench"
    r = CliRunner().invoke(main, ["bench", str(sl), "--requests", "auto", "--kv-memory", "96KiB", "--prompt-len",
                                  "24", "--gen-len", "40", "--duration", "0.000001", "--no-warmup", "--out", str(out)])
    assert r.exit_code == 0, r.output
    assert "(0 done)" in r.output and "--duration stopped runs" in r.output
    row = json.loads((out / "results.json").read_text())["results"][0]
    assert row["cut_at_s"] > 0 and row["requests_finished"] == 0
    assert 0 < row["output_tokens"] < row["admission_batch"] * 40  # only what the admitted ones made by the stop


def test_memory_limited_run_bad_input(tmp_path):
    run = lambda *a: subprocess.run([sys.executable, "-m", "trtkv.cli", "bench", *a], capture_output=True,  # noqa: E731
                                    text=True, timeout=120)
    assert_one_line_error(run(str(tmp_path), "--requests", "auto"), "pass --kv-memory")
    assert_one_line_error(run(str(tmp_path), "--requests", "0", "--kv-memory", "1GiB"), "positive integer or 'auto'")
    assert_one_line_error(run(str(tmp_path), "--requests", "many", "--kv-memory", "1GiB"), "positive integer or 'auto'")
    assert_one_line_error(run(str(tmp_path), "--duration", "60"), "pass it with --requests")
    assert_one_line_error(run(str(tmp_path), "--requests", "4", "--kv-memory", "1GiB", "--duration", "0"),
                          "positive number of seconds")
    assert_one_line_error(run(str(tmp_path), "--prefill-tokens", "0"), "positive number of tokens")
