"""The ``trtkv`` command line. Bad input ends with one ``trtkv: error: ...`` line and exit code 2."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from trtkv.errors import TrtkvError
from trtkv.export import DEFAULT_OPSET

EXIT_USAGE = 2


class TrtkvGroup(click.Group):
    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
            if not isinstance(rv, int):
                return rv
            code = rv
        except SystemExit as e:  # a command's own sys.exit (serve's status)
            code = e.code
        except click.exceptions.Abort:
            click.echo("trtkv: aborted", err=True)
            code = 130
        except click.exceptions.Exit as e:
            code = e.exit_code
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            click.echo(f"trtkv: error: {e.format_message()}{hint}", err=True)
            code = EXIT_USAGE
        except TrtkvError as e:
            click.echo(f"trtkv: error: {e}", err=True)
            code = EXIT_USAGE
        except KeyboardInterrupt:
            click.echo("trtkv: interrupted", err=True)
            code = 130
        _exit(code)


def _exit(code) -> None:
    """Exit with ``code``; a tensor-parallel process whose group was lost exits without the interpreter's teardown
    (``trtkv.distributed.launch.exit_process``). The module is looked up, not imported: it pulls in torch."""
    launch = sys.modules.get("trtkv.distributed.launch")
    if launch is not None and isinstance(code, int):
        launch.exit_process(code)
    sys.exit(code)


@click.group(cls=TrtkvGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name=None, version=__import__("trtkv").__version__, prog_name="trtkv")
def main() -> None:
    """Build, run, measure and serve reasoning LLMs with compressed KV caches."""


# --- tensor parallelism -------------------------------------------------------------------------
def tp_option(f):
    return click.option("--tp", type=int, default=None, metavar="N",
                        help="Tensor-parallel ranks (processes, one per GPU on CUDA) [the engine's --tp, else 1].")(f)


def join_ranks(tp: int | None, engines: list[Path], device: str | None = None) -> int:
    """The tensor-parallel size a command runs with (``--tp``, else the engines' own), its ranks started (this
    process is rank 0) or joined (a rank trtkv or ``torchrun`` started)."""
    from trtkv.artifacts.engine_dir import engine_tp
    from trtkv.distributed.launch import join_ranks as join

    tp = engine_tp(tp, engines)
    join(tp, device)
    return tp


# --- models -------------------------------------------------------------------------------------
@main.group()
def models() -> None:
    """The model registry (configs/models.yaml)."""


@models.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def models_list(as_json: bool) -> None:
    """List model aliases."""
    from trtkv.models.fetch import READY_MARKER, checkpoint_dir
    from trtkv.models.registry import load_registry

    rows = []
    for spec in load_registry().values():
        d = spec.summary()
        d["fetched"] = (checkpoint_dir(spec) / READY_MARKER).is_file()
        rows.append(d)
    if as_json:
        click.echo(json.dumps(rows, indent=2))
        return
    for d in rows:
        mark = "fetched" if d["fetched"] else ""
        click.echo(f"{d['name']:<16} {d.get('architecture', '?'):<6} {d.get('params_b', 0):>7.3f}B  "
                   f"{d['source'].get('kind', ''):<10} {mark:<8} {d['description']}")


@models.command("fetch")
@click.argument("name")
def models_fetch(name: str) -> None:
    """Download (and convert) a model's weights into the local cache."""
    from trtkv.models.fetch import fetch
    from trtkv.models.registry import resolve_model

    path = fetch(resolve_model(name))
    click.echo(str(path))


# --- policies -----------------------------------------------------------------------------------
@main.group()
def policies() -> None:
    """KV-cache policies."""


@policies.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON.")
def policies_list(as_json: bool) -> None:
    """List policies with a one-line description and their parameters."""
    from trtkv.policies import describe_policies

    rows = describe_policies()
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return
    for d in rows:
        params = ", ".join(f"{k}={v}" for k, v in d["params"].items())
        click.echo(f"{d['name']:<14} {d['description']}\n{'':<14} {params}")


# --- build / generate ---------------------------------------------------------------------------
@main.command()
@click.option("--model", required=True, help="Registry alias, hub id (org/name) or local checkpoint directory.")
@click.option("--policy", default="full", show_default=True, help="KV policy (see `trtkv policies list`).")
@click.option("--budget", type=int, default=None, help="Token budget per layer for evicting policies.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Policy or cache parameter (repeatable).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Engine directory [engines/MODEL-POLICY].")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="Weight/compute dtype [fp32 on CPU, bf16 on GPU]; on CPU, bf16 computes in bf16 where the "
                   "CPU has AVX512-BF16 or AMX, else in fp32.")
@click.option("--weights", type=click.Choice(["dense", "int8", "int4"]), default="dense", show_default=True,
              help="Weight format: dense (the dtype's), int8 (one scale per output channel) or int4 (one scale per "
                   "output channel and --group-size inputs); weight-only, CPU, fp32 dtype; stored in the engine.")
@click.option("--group-size", type=int, default=None, help="int4 weights: inputs sharing one scale [32].")
@click.option("--synthetic-weights", is_flag=True, help="Random weights of the registry shape (speed/memory work).")
@click.option("--seed", type=int, default=0, help="Seed of synthetic weights.")
@click.option("--calibration", "calibration_file", type=click.Path(path_type=Path), default=None,
              help="ThinKV: reuse a calibration JSON (from `trtkv calibrate`).")
@click.option("--calib-prompts", type=click.IntRange(min=1), default=None,
              help="ThinKV: calibration prompts when calibrating at build time [16 on CPU, 100 on GPU].")
@click.option("--calib-max-tokens", type=click.IntRange(min=8), default=None,
              help="ThinKV: tokens generated per calibration prompt [192 on CPU, 2048 on GPU].")
@click.option("--kv-memory", default=None, metavar="SIZE",
              help="KV memory the cache pools may hold (e.g. 2GiB); same as --set kv_memory=SIZE.")
@click.option("--tp", type=int, default=1, show_default=True, metavar="N",
              help="Tensor-parallel ranks the engine runs on by default (generate, bench, eval, search, serve).")
def build(model, policy, budget, sets, out, dtype, weights, group_size, synthetic_weights, seed, calibration_file,
          calib_prompts, calib_max_tokens, kv_memory, tp) -> None:
    """Build an engine directory for MODEL and POLICY.

    --set takes policy parameters and the cache settings block_size, eviction, max_batch, max_pages, kv_memory,
    kv_memory_fraction, demote and host_kv_memory."""
    from trtkv.build.builder import build_engine
    from trtkv.settings import parse_sets

    if budget is not None and budget <= 0:
        raise TrtkvError(f"--budget must be positive, got {budget}")
    settings = parse_sets(sets)
    if kv_memory is not None:
        if "kv_memory" in settings:
            raise TrtkvError("give the KV memory once: --kv-memory or --set kv_memory, not both")
        settings["kv_memory"] = kv_memory
    out = out or Path("engines") / f"{Path(model).name}-{policy}"
    path = build_engine(model, policy, out, budget=budget, settings=settings, dtype=dtype,
                        synthetic=synthetic_weights, seed=seed, calibration_file=calibration_file,
                        calib_prompts=calib_prompts, calib_max_tokens=calib_max_tokens, weights=weights,
                        group_size=group_size, tp=tp)
    click.echo(f"engine written to {path}")


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text (wrapped in the chat template unless --raw).")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--repetition-penalty", type=float, default=1.0, show_default=True,
              help="Divide the logits of tokens already in the context (transformers' rule; 1 = off).")
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS (benchmarks).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, token_ids and stats.")
@click.option("--kv-memory", default=None, metavar="SIZE", help="Cap on device KV bytes (e.g. 64MiB).")
@click.option("--host-kv-memory", default=None, metavar="SIZE", help="Cap on host-tier KV bytes (T1 + T2).")
@click.option("--demote", default=None, metavar="MODE",
              help="Evictions become moves to host memory: none, host, host-<format> [the engine's setting].")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Load-time cache setting (max_pages, kv_memory, kv_memory_fraction, max_batch...) or policy "
                   "parameter (repeatable).")
@click.option("--runtime", type=click.Choice(["torch", "torch-compile", "graph", "onnxruntime"]), default="torch",
              show_default=True, help="What runs the model steps: PyTorch; PyTorch with the dense layers through "
              "torch.compile; each steady decode step as one compiled program (graph); or ONNX Runtime on the "
              "engine's ONNX export.")
@click.option("--onnx-dir", type=click.Path(path_type=Path), default=None,
              help="--runtime onnxruntime: the export directory [ENGINE/onnx, exported there when missing].")
@tp_option
def generate(engine, prompt, max_tokens, temperature, top_k, top_p, repetition_penalty, seed, stop, raw, ignore_eos,
             as_json, kv_memory, host_kv_memory, demote, sets, runtime, onnx_dir, tp) -> None:
    """Generate text with ENGINE (streams to the terminal)."""
    from trtkv.api import Engine, SamplingParams
    from trtkv.settings import parse_sets, split_settings

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p,
                            repetition_penalty=repetition_penalty, seed=seed, stop=tuple(stop), chat=not raw,
                            ignore_eos=ignore_eos)
    params.validate()
    overrides = {k: v for k, v in (("kv_memory", kv_memory), ("host_kv_memory", host_kv_memory), ("demote", demote))
                 if v is not None}
    policy_overrides, cache_sets = split_settings(parse_sets(sets))
    for k, v in cache_sets.items():
        if k in overrides:
            raise TrtkvError(f"give {k} once: --{k.replace('_', '-')} or --set {k}, not both")
        overrides[k] = v
    tp = join_ranks(tp, [engine])
    eng = Engine.load(engine, cache_overrides=overrides or None, policy_overrides=policy_overrides or None,
                      runtime=runtime, onnx_dir=onnx_dir, tp=tp)
    from trtkv.runtime.long_lived import frozen_gc  # (lazily: trtkv.runtime imports torch)

    result = None
    with frozen_gc():
        if as_json:
            click.echo(json.dumps(eng.generate(prompt, params)[0].to_dict()))
            return
        for ev in eng.stream(prompt, params):
            click.echo(ev.text, nl=False)
            if ev.finished:
                result = ev.result
                if ev.error:
                    click.echo()
                    raise TrtkvError(ev.error)
    click.echo()
    if result is not None:
        s = result.stats
        click.echo(f"[{s['generated_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s | KV {s['kv_bytes'] / 1e6:.2f} MB "
                   f"(peak {s['peak_kv_bytes'] / 1e6:.2f} MB) of {s['kv_bytes_full'] / 1e6:.2f} MB fp16 "
                   f"({100 * s['kv_bytes'] / max(1, s['kv_bytes_full']):.1f}%) | {s['live_tokens']} tokens live in "
                   f"{s['pages']} pages per layer, {s['evicted_tokens']} evicted]", err=True)
        if s.get("kv_bytes_host") or s.get("transfer_bytes"):
            click.echo(f"[tiers: device {s['kv_bytes_device'] / 1e6:.2f} MB ({s['tokens_device']} tokens, staging "
                       f"included), host {s['kv_bytes_host'] / 1e6:.2f} MB ({s['tokens_host']} tokens), "
                       f"{s['transfer_bytes'] / 1e6:.1f} MB moved, {s['kv_move_s']:.3f} s copying]", err=True)


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
def info(engine) -> None:
    """Print an engine's manifest."""
    from trtkv.artifacts.engine_dir import read_manifest

    click.echo(json.dumps(read_manifest(engine).to_dict(), indent=2))


# --- calibrate ----------------------------------------------------------------------------------
@main.command()
@click.argument("model")
@click.option("--prompts", "n_prompts", type=int, default=100, show_default=True,
              help="Number of calibration prompts (the first N of the set).")
@click.option("--max-tokens", type=int, default=1024, show_default=True, help="New tokens per prompt.")
@click.option("--stride", type=int, default=1, show_default=True, help="Record every S-th decode step.")
@click.option("--layers", "num_layers", type=int, default=4, show_default=True,
              help="Number of calibration layers ℓ* to select.")
@click.option("--min-keys", type=int, default=64, show_default=True,
              help="Only record steps whose attention row has at least this many keys.")
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="Calibration prompts JSONL (default: the calibration set, see trtkv.eval.datasets).")
@click.option("--out", type=click.Path(path_type=Path), default=None,
              help="Artifact JSON [calibration-MODEL.json].")
@click.option("--plot", type=click.Path(path_type=Path), default=None,
              help="Evidence PNG (per-layer sparsity densities) [OUT with .png].")
@click.option("--no-plot", is_flag=True, help="Do not write the PNG.")
@click.option("--target-shares", default="E=0.2,R=0.6,T=0.2", show_default=True,
              help="Thought shares the fallback rule matches when no layer is tri-modal.")
@click.option("--fallback-types", type=click.Choice(["1", "3"]), default="1", show_default=True,
              help="Thought types ThinKV uses when no layer is tri-modal: 1 (the paper's §E.10 setting for "
                   "LLMs) or 3 (the quantile bands).")
@click.option("--temperature", type=float, default=None,
              help="Sampling temperature [the model's generation_config default, else greedy].")
@click.option("--batch-size", type=int, default=None, help="Prompts decoded together [8 on CPU, 32 on CUDA].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--device", default=None, help="cpu or cuda [cuda when available].")
@click.option("--dtype", type=click.Choice(["fp32", "fp16", "bf16"]), default=None,
              help="Compute dtype of the temporary engine [fp32 on CPU, bf16 on GPU].")
@click.option("--synthetic-weights", is_flag=True, help="Random weights of the registry shape (testing only).")
@click.option("--save-raw", type=click.Path(path_type=Path), default=None,
              help="Also save the recorded per-step sparsities (.npz) for re-analysis.")
@click.option("--from-raw", type=click.Path(path_type=Path), default=None,
              help="Re-analyse a --save-raw file instead of generating (e.g. another --layers or --target-shares).")
def calibrate(model, n_prompts, max_tokens, stride, num_layers, min_keys, data, out, plot, no_plot, target_shares,
              fallback_types, temperature, batch_size, seed, device, dtype, synthetic_weights, save_raw,
              from_raw) -> None:
    """ThinKV calibration: pick the sparsity layers and thought thresholds for MODEL.

    MODEL is a registry alias, a checkpoint directory or an engine directory. A temporary full-cache
    engine generates on the calibration prompts while ThinKV's attention sparsity is recorded; the
    artifact feeds `trtkv build --policy thinkv --calibration FILE`.
    """
    import time

    from trtkv.build import calibration as cal

    for name, v in (("--prompts", n_prompts), ("--max-tokens", max_tokens), ("--stride", stride),
                    ("--layers", num_layers), ("--min-keys", min_keys)):
        if v <= 0:
            raise TrtkvError(f"{name} must be positive, got {v}")
    if batch_size is not None and batch_size <= 0:
        raise TrtkvError(f"--batch-size must be positive, got {batch_size}")
    shares = cal.parse_shares(target_shares)
    out = out or Path(f"calibration-{Path(model.rstrip('/')).name}.json")
    png = None if no_plot else (plot or out.with_suffix(".png"))
    t0 = time.perf_counter()
    art = cal.calibrate(model, n_prompts, max_tokens, stride, num_layers, data, min_keys=min_keys,
                        batch_size=batch_size, temperature=temperature, seed=seed, target_shares=shares,
                        device=device, dtype=dtype, synthetic=synthetic_weights, plot=png,
                        log=lambda s: click.echo(s, err=True), raw_out=save_raw, raw_in=from_raw,
                        fallback_types=int(fallback_types))
    cal.save_calibration(art, out)
    for line in cal.summary_lines(art):
        click.echo(line, err=line.startswith(("!", "WARNING")))
    click.echo(f"calibration written to {out}" + (f", plot {png}" if png else "")
               + f" ({time.perf_counter() - t0:.1f} s)")


# --- bench / eval -------------------------------------------------------------------------------
def _command_line(name: str) -> str | None:
    """The command as typed, for the results file (None when not run from a shell, e.g. in tests)."""
    import shlex

    return "trtkv " + shlex.join(sys.argv[1:]) if sys.argv[1:2] == [name] else None


@main.command()
@click.argument("engines", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--batch-sizes", default="1,8,32", show_default=True, help="Comma-separated batch sizes.")
@click.option("--prompt-len", type=int, default=512, show_default=True, help="Prompt tokens per request.")
@click.option("--gen-len", type=int, default=256, show_default=True,
              help="Generated tokens per request (EOS ignored, so exactly this many).")
@click.option("--kv-memory", default=None, metavar="SIZE",
              help="KV memory (e.g. 2GiB, 80GB) for the largest-batch-that-fits estimate; with --requests, each "
                   "engine's KV pools.")
@click.option("--requests", "requests", default=None, metavar="N|auto",
              help="Memory-limited throughput (the seed paper's Table 2): queue N requests per engine (auto: twice "
                   "its largest batch), admit as many as --kv-memory holds, the next as one finishes.")
@click.option("--duration", "duration_s", type=float, default=None, metavar="SECONDS",
              help="With --requests: stop each engine's run after SECONDS (tok/s steady is then the window reached; "
                   "requests running at the stop are cut short).")
@click.option("--host-kv-memory", default=None, metavar="SIZE", help="Cap on host-tier KV bytes (T1 + T2).")
@click.option("--prefill-tokens", type=int, default=None, metavar="N",
              help="Prompt tokens packed into one prefill pass of admitted requests (1: one prompt a pass) "
                   "[default: the scheduler's, 8192].")
@click.option("--repeat", type=int, default=1, show_default=True, help="Repeats, engines interleaved in each.")
@click.option("--prompt", "prompt_source", type=click.Choice(["text", "ids"]), default="text", show_default=True,
              help="Prompts: packaged reasoning-trace text tokenized and repeated to length, or random token ids.")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Policy parameter override applied to every engine (repeatable).")
@click.option("--device", default=None, help="cpu or cuda [cuda when available].")
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--no-warmup", is_flag=True, help="Skip the short warm-up generation per engine.")
@click.option("--profile", is_flag=True,
              help="Split each decode step into model, attention, kv_write, policy and bookkeeping time.")
@click.option("--out", type=click.Path(path_type=Path), default=Path("bench-results"), show_default=True,
              help="Directory for results.json, results.csv and the plots.")
@click.option("--runtime", default="torch", show_default=True, metavar="NAMES",
              help="torch, torch-compile, graph, onnxruntime, or several comma-separated (each engine runs under each, "
                   "interleaved).")
@tp_option
def bench(engines, batch_sizes, prompt_len, gen_len, kv_memory, requests, duration_s, host_kv_memory,
          prefill_tokens, repeat, prompt_source, sets, device, seed, no_warmup, profile, out, runtime, tp) -> None:
    """Latency, throughput and KV memory of ENGINES over batch sizes, measured in one run."""
    from trtkv.bench import BenchConfig, load_engines, parse_batch_sizes, parse_size, run_bench
    from trtkv.bench.records import parse_requests
    from trtkv.bench.report import print_bench
    from trtkv.bench.summary import write_results
    from trtkv.settings import parse_sets

    n_requests, requests_auto = parse_requests(requests)
    cfg = BenchConfig(batch_sizes=parse_batch_sizes(batch_sizes), prompt_len=prompt_len, gen_len=gen_len,
                      kv_memory=parse_size(kv_memory) if kv_memory else None, repeat=repeat, warmup=not no_warmup,
                      prompt_source=prompt_source, seed=seed, profile=profile, requests=n_requests,
                      requests_auto=requests_auto, duration_s=duration_s,
                      **({} if prefill_tokens is None else {"prefill_tokens": prefill_tokens})).validate()
    sets = {**parse_sets(sets), **({"host_kv_memory": host_kv_memory} if host_kv_memory else {})}
    from trtkv.api import RUNTIMES

    runtimes = tuple(dict.fromkeys(r.strip() for r in runtime.split(",") if r.strip()))
    if not runtimes or any(r not in RUNTIMES for r in runtimes):
        raise TrtkvError(f"--runtime {runtime!r}: choose {', '.join(RUNTIMES)}, or several comma-separated")
    if profile and "onnxruntime" in runtimes:
        raise TrtkvError("--profile splits the PyTorch runtime's decode step; ONNX Runtime runs it as one graph: "
                         "profile with --runtime torch")
    from trtkv.distributed.launch import rank_out

    tp = join_ranks(tp, list(engines), device)
    loaded = load_engines(list(engines), device=device, policy_overrides=sets or None, runtimes=runtimes, tp=tp)
    from trtkv.runtime.long_lived import frozen_gc

    with frozen_gc():
        doc = run_bench(loaded, cfg, command=_command_line("bench"))
    written = write_results(doc, rank_out(out))
    print_bench(doc)
    click.echo(f"results written to {out}/ ({', '.join(p.name for p in written)})")


@main.command("eval")
@click.argument("engines", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--task", required=True, type=click.Choice(["fidelity", "gsm8k", "math500", "aime24", "aime25"]),
              help="fidelity: teacher-forced trace replay against a full cache; else task accuracy.")
@click.option("--data", type=click.Path(path_type=Path), default=None,
              help="Data file (default: the shared data directory, else the packaged subset).")
@click.option("--limit", type=int, default=None, help="Use only the first N traces/problems.")
@click.option("--max-tokens", type=int, default=None,
              help="Forced tokens per trace (fidelity, default 1024) or generated tokens (tasks, default 2048).")
@click.option("--samples", type=int, default=1, show_default=True, help="Samples per problem (pass@1 over K).")
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--reference", type=click.Path(path_type=Path), default=None,
              help="Fidelity: a full engine of the same model [a full cache built on the engine's own weights].")
@click.option("--recall-layers", default="8", show_default=True,
              help="Fidelity: layers for attention recall: 'all', a count (evenly spaced), indices 0,5,9, or 'none' "
                   "(fastest: no attention weights beyond what the policies ask for).")
@click.option("--topk", type=int, default=10, show_default=True, help="Fidelity: top-k attended tokens recalled.")
@click.option("--batch", type=int, default=None, help="Requests run together [fidelity 4; tasks: engine max_batch].")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE",
              help="Policy parameter override applied to every engine (repeatable).")
@click.option("--device", default=None, help="cpu or cuda [cuda when available].")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Directory for results.json and plots.")
@click.option("--runtime", type=click.Choice(["torch", "torch-compile", "graph"]), default="torch", show_default=True,
              help="What runs the engines' model steps (task accuracy; fidelity replays every engine in lockstep "
                   "with the reference, layer by layer, under any).")
@tp_option
def eval_cmd(engines, task, data, limit, max_tokens, samples, temperature, top_p, seed, reference, recall_layers,
             topk, batch, sets, device, out, runtime, tp) -> None:
    """Fidelity against a full cache, or accuracy on a math task, of ENGINES."""
    from trtkv.bench.runner import load_engines, machine_info
    from trtkv.eval import DataFileNotFoundError, load_problems, load_traces
    from trtkv.eval.run import print_eval, run_accuracy, run_fidelity, write_eval
    from trtkv.settings import parse_sets

    for name, v in (("--limit", limit), ("--max-tokens", max_tokens), ("--batch", batch), ("--topk", topk),
                    ("--samples", samples)):
        if v is not None and v <= 0:
            raise TrtkvError(f"{name} must be positive, got {v}")
    if not 0.0 <= temperature <= 100.0:
        raise TrtkvError(f"--temperature must be in [0, 100], got {temperature}")
    try:
        items = load_traces(data, limit) if task == "fidelity" else load_problems(task, data, limit)
    except DataFileNotFoundError as e:
        raise TrtkvError(str(e)) from None
    except (ValueError, KeyError, json.JSONDecodeError) as e:
        raise TrtkvError(f"cannot read the {task} data ({type(e).__name__}: {e})") from None
    from trtkv.distributed.launch import rank_out

    overrides = parse_sets(sets) or None
    tp = join_ranks(tp, list(engines) + ([reference] if reference is not None else []), device)
    out = rank_out(out)
    loaded = load_engines(list(engines), device=device, policy_overrides=overrides, runtimes=(runtime,), tp=tp)
    ref = load_engines([reference], device=device, runtimes=(runtime,), tp=tp)[0] if reference is not None else None
    cfg = {"task": task, "data": str(data) if data else None, "limit": limit, "seed": seed}
    from trtkv.runtime.long_lived import frozen_gc

    with frozen_gc():
        if task == "fidelity":
            cfg.update(max_tokens=max_tokens or 1024, recall_layers=recall_layers, topk=topk, batch=batch or 4)
            records = run_fidelity(loaded, items, cfg["max_tokens"], ref, recall_layers, topk, cfg["batch"])
            rows = None
        else:
            cfg.update(max_tokens=max_tokens or 2048, samples=samples, temperature=temperature, top_p=top_p)
            records, rows = run_accuracy(loaded, task, items, samples, cfg["max_tokens"], temperature, top_p, seed,
                                         batch)
    doc = {"kind": "trtkv-eval", "version": 1, "task": task, "command": _command_line("eval"),
           "machine": machine_info(str(loaded[0].engine.core.device)), "config": cfg, "records": records}
    print_eval(doc)
    if out is not None:
        written = write_eval(out, doc, rows)
        click.echo(f"results written to {out}/ ({', '.join(p.name for p in written)})")


@main.command("eval-merge")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--out", type=click.Path(path_type=Path), required=True, help="Directory for the merged results.")
def eval_merge_cmd(runs, out) -> None:
    """One fidelity table and Pareto frontier from RUNS (trtkv eval --out directories) over the same traces."""
    from trtkv.eval.merge import merge_runs, read_run
    from trtkv.eval.run import print_eval, write_eval

    doc = merge_runs([read_run(p) for p in runs])
    doc["command"] = _command_line("eval-merge")
    print_eval(doc)
    written = write_eval(out, doc)
    click.echo(f"results written to {out}/ ({', '.join(p.name for p in written)})")


@main.command("search")
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--task", required=True, help="game24 (generated puzzles), gsm8k or math500.")
@click.option("--limit", type=int, default=None, help="Problems to search [game24: 20; math: all].")
@click.option("--data", default=None, help="Math data file (default: the shared data directory).")
@click.option("--preset", type=click.Choice(["S", "L"]), default="S", show_default=True,
              help="Config-S (branching 3, depth 6, 64 expansions, 128-token blocks) or Config-L (5/8/256/128).")
@click.option("--branching", type=int, default=None, help="Most children per node [preset].")
@click.option("--depth", type=int, default=None, help="Deepest block [preset].")
@click.option("--expansions", type=int, default=None, help="Blocks generated per problem [preset].")
@click.option("--node-tokens", type=int, default=None, help="Most tokens per block [preset].")
@click.option("--temperature", type=float, default=0.7, show_default=True)
@click.option("--top-p", type=float, default=0.9, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--oracle", type=click.Path(path_type=Path), default=None,
              help="A full-cache search's output (for --set budget_basis=oracle_peak).")
@click.option("--chat", is_flag=True, help="Wrap problems in the model's chat template (default: raw prompt).")
@click.option("--shard", default="0/1", show_default=True, metavar="I/N",
              help="Run only problems I, I+N, ... (parallel runs; merge with python -m trtkv.search.report).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Policy parameter override (repeatable).")
@click.option("--device", default=None, help="cpu or cuda [cuda when available].")
@click.option("--out", type=click.Path(path_type=Path), required=True,
              help="Directory for results.json, results.csv, timelines.json and live_kv.png.")
@tp_option
def search_cmd(engine, task, limit, data, preset, branching, depth, expansions, node_tokens, temperature, top_p,
               seed, oracle, chat, shard, sets, device, out, tp) -> None:
    """Tree-of-thought search with ENGINE's policy over a task's problems (forks share the path's pages)."""
    from trtkv.api import Engine
    from trtkv.search import SearchConfig, get_task
    from trtkv.search.report import write_search
    from trtkv.search.run import run_search_task
    from trtkv.settings import parse_sets

    get_task(task)
    over = {k: v for k, v in (("branching", branching), ("depth", depth), ("expansions", expansions),
                               ("node_tokens", node_tokens)) if v is not None}
    cfg = SearchConfig.preset(preset, temperature=temperature, top_p=top_p, seed=seed, chat=chat, **over)
    try:
        si, sn = (int(x) for x in shard.split("/"))
        assert 0 <= si < sn
    except (ValueError, AssertionError):
        raise TrtkvError(f"--shard must be I/N with 0 <= I < N, got {shard!r}") from None
    from trtkv.distributed.launch import rank_out

    tp = join_ranks(tp, [engine], device)
    eng = Engine.load(engine, device=device, policy_overrides=parse_sets(sets) or None, tp=tp)

    def progress(i, n, rec):
        click.echo(f"[{i}/{n}] {rec['problem']}: correct={rec['correct']} expansions={rec['expansions']} "
                   f"peak_cached_tokens={rec['peak_cached_tokens']} rehydrations={rec['rehydrations']} "
                   f"{rec['latency_s']:.1f}s", err=True)

    doc = run_search_task(eng, task, cfg, limit, data, oracle, progress, (si, sn))
    doc["command"] = _command_line("search")
    written = write_search(rank_out(out), doc)
    s = doc["summary"]
    click.echo(f"{task}: {s['correct']}/{s['problems']} correct; peak cached tokens mean "
               f"{s['peak_cached_tokens_mean']:.0f} (max {s['peak_cached_tokens_max']}); peak KV bytes mean "
               f"{s['peak_kv_bytes_mean']:.0f}; rehydrations {s['rehydrations_total']}")
    click.echo(f"results written to {out}/ ({', '.join(p.name for p in written)})")


# --- serving (commands live in trtkv.serve; their heavy imports happen when they run) -------------
def _add_serving_commands() -> None:
    from trtkv.serve.__main__ import deploy, serve, tritonserver

    for cmd in (serve, deploy, tritonserver):
        main.add_command(cmd)


_add_serving_commands()


# --- export (heavy imports when it runs) ---------------------------------------------------------
@main.command("export")
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--out", required=True, type=click.Path(path_type=Path), help="Directory for the ONNX files.")
@click.option("--opset", type=int, default=DEFAULT_OPSET, show_default=True, help="Default-domain opset (18..23).")
@click.option("--inline", is_flag=True, help="Inline the trtkv functions (for tools that cannot read functions).")
@click.option("--set", "sets", multiple=True, metavar="KEY=VALUE", help="Policy parameter override (repeatable).")
@click.option("--check", is_flag=True,
              help="Then check the graphs against the PyTorch engine in lockstep: every step run by ONNX Runtime "
                   "(through Polygraphy) and by PyTorch from the same cache state; compares logits, greedy tokens "
                   "and the stored KV records (midpoint flips reported apart from real mismatches).")
@click.option("--atol", type=float, default=1e-2, show_default=True, help="--check: absolute logits tolerance.")
@click.option("--rtol", type=float, default=1e-2, show_default=True, help="--check: relative logits tolerance.")
@click.option("--check-steps", type=click.IntRange(1, 4096), default=48, show_default=True,
              help="--check: greedy decode steps per prompt.")
def export_cmd(engine, out, opset, inline, sets, check, atol, rtol, check_steps) -> None:
    """Write ENGINE's prefill and decode steps as ONNX (trtkv plugins as trtkv-domain functions) to --out."""
    from trtkv.export import require_onnx
    from trtkv.settings import parse_sets

    require_onnx()
    from trtkv.api import Engine
    from trtkv.export.exporter import check_exportable, export_engine

    eng = Engine.load(engine, device="cpu", policy_overrides=parse_sets(sets) or None)
    check_exportable(eng)
    m = export_engine(eng, out, opset=opset, inline=inline, log=lambda msg: click.echo(msg, err=True))
    click.echo(f"exported {m.policy} engine ({', '.join(m.kv.formats)}) to {out} "
               f"({', '.join(g.file for g in m.graphs.values())}, export.json)")
    if check:
        from trtkv.export.check import CHECK_PROMPTS, run_check

        click.echo(f"check: ONNX Runtime (Polygraphy) and PyTorch in lockstep from the same cache state, "
                   f"{len(CHECK_PROMPTS)} prompts x {check_steps} greedy steps")
        report = run_check(eng, out, atol=atol, rtol=rtol, steps=check_steps, log=click.echo)
        if not report.passed:
            failed = [g.graph for g in report.graphs if not g.passed]
            what = [f"logits of {', '.join(failed)} outside atol {atol:g} / rtol {rtol:g}"] if failed else []
            what += [f"{report.mismatch_count} real mismatches"] if report.mismatch_count else []
            raise TrtkvError(f"export check failed: {'; '.join(what)}")


if __name__ == "__main__":
    main()
