"""The ``trtkv`` command line. Bad input ends with one ``trtkv: error: ...`` line and exit code 2."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import click

from trtkv.errors import TrtkvError

EXIT_USAGE = 2


class TrtkvGroup(click.Group):
    def main(self, *args, **kwargs):
        kwargs["standalone_mode"] = False
        try:
            rv = super().main(*args, **kwargs)
            if isinstance(rv, int):
                sys.exit(rv)
            return rv
        except click.exceptions.Abort:
            click.echo("trtkv: aborted", err=True)
            sys.exit(130)
        except click.exceptions.Exit as e:
            sys.exit(e.exit_code)
        except click.ClickException as e:
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            click.echo(f"trtkv: error: {e.format_message()}{hint}", err=True)
            sys.exit(EXIT_USAGE)
        except TrtkvError as e:
            click.echo(f"trtkv: error: {e}", err=True)
            sys.exit(EXIT_USAGE)
        except KeyboardInterrupt:
            click.echo("trtkv: interrupted", err=True)
            sys.exit(130)


def parse_sets(values: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in values:
        if "=" not in item:
            raise TrtkvError(f"--set {item!r}: expected key=value")
        k, v = item.split("=", 1)
        if not k.strip():
            raise TrtkvError(f"--set {item!r}: empty key")
        out[k.strip()] = v.strip()
    return out


@click.group(cls=TrtkvGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name=None, version=__import__("trtkv").__version__, prog_name="trtkv")
def main() -> None:
    """Build, run, measure and serve reasoning LLMs with compressed KV caches."""


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
              help="Weight/compute dtype [fp32 on CPU, bf16 on GPU].")
@click.option("--synthetic-weights", is_flag=True, help="Random weights of the registry shape (speed/memory work).")
@click.option("--seed", type=int, default=0, help="Seed of synthetic weights.")
def build(model, policy, budget, sets, out, dtype, synthetic_weights, seed) -> None:
    """Build an engine directory for MODEL and POLICY."""
    from trtkv.build.builder import build_engine

    if budget is not None and budget <= 0:
        raise TrtkvError(f"--budget must be positive, got {budget}")
    out = out or Path("engines") / f"{Path(model).name}-{policy}"
    path = build_engine(model, policy, out, budget=budget, settings=parse_sets(sets), dtype=dtype,
                        synthetic=synthetic_weights, seed=seed)
    click.echo(f"engine written to {path}")


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
@click.option("--prompt", required=True, help="Prompt text (wrapped in the chat template unless --raw).")
@click.option("--max-tokens", type=int, default=256, show_default=True)
@click.option("--temperature", type=float, default=0.0, show_default=True)
@click.option("--top-k", type=int, default=0, show_default=True)
@click.option("--top-p", type=float, default=1.0, show_default=True)
@click.option("--seed", type=int, default=None)
@click.option("--stop", multiple=True, help="Stop string (repeatable).")
@click.option("--raw", is_flag=True, help="Do not apply the chat template.")
@click.option("--ignore-eos", is_flag=True, help="Keep generating past EOS (benchmarks).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object with text, token_ids and stats.")
def generate(engine, prompt, max_tokens, temperature, top_k, top_p, seed, stop, raw, ignore_eos, as_json) -> None:
    """Generate text with ENGINE (streams to the terminal)."""
    from trtkv.api import Engine, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed,
                            stop=tuple(stop), chat=not raw, ignore_eos=ignore_eos)
    params.validate()
    eng = Engine.load(engine)
    if as_json:
        res = eng.generate(prompt, params)[0]
        click.echo(json.dumps(res.to_dict()))
        return
    result = None
    for ev in eng.stream(prompt, params):
        click.echo(ev.text, nl=False)
        if ev.finished:
            result = ev.result
    click.echo()
    if result is not None:
        s = result.stats
        click.echo(f"[{s['generated_tokens']} tokens, {s['tokens_per_s']:.1f} tok/s, KV {s['kv_bytes'] / 1e6:.2f} MB "
                   f"of {s['kv_bytes_full'] / 1e6:.2f} MB fp16 ({100 * s['kv_bytes'] / max(1, s['kv_bytes_full']):.1f}%)]",
                   err=True)


@main.command()
@click.argument("engine", type=click.Path(path_type=Path))
def info(engine) -> None:
    """Print an engine's manifest."""
    from trtkv.build.engine_dir import read_manifest

    click.echo(json.dumps(read_manifest(engine), indent=2))


if __name__ == "__main__":
    main()
