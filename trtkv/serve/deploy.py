"""Write a Triton model repository for an engine and run it under tritonserver.

The repository is the standard Python-backend layout (`config.pbtxt`,
`1/model.py`, plus `model.json` naming the engine, as Triton's vLLM backend
does).  Running it needs more than the repository, because the tritonserver
bundled in the `nvidia-pytriton` wheel ships its Python backend without a
stub and its stub embeds whatever `libpython3.X` the loader finds first:

* `prepare_backends` assembles a backend directory with the stub built for
  this Python (PyTriton does the same in its private workspace);
* `tritonserver_env` puts this interpreter's LIBDIR first on
  LD_LIBRARY_PATH, this environment's `bin` first on PATH (the stub finds
  its `sys.prefix`, hence the venv's site-packages, through the `python3`
  on PATH) and trtkv's source root on PYTHONPATH when trtkv is not installed.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import uuid
from pathlib import Path

from trtkv.serve import shm
from trtkv.serve.protocol import INPUTS, OUTPUTS
from trtkv.serve.restrictions import grpc_restriction, http_restriction

DRAIN_ENV = "TRTKV_DRAIN_FILE"  # read by triton_model.py, which cannot import this module's deps

MODEL_PY = '''"""Triton Python-backend entry point written by trtkv.serve.deploy.

The implementation lives in trtkv (trtkv/serve/triton_model.py) so that
upgrading trtkv upgrades this model; model.json names the engine.
"""

from trtkv.serve.triton_model import TritonPythonModel  # noqa: F401
'''


def _io_block(kind: str, ios) -> str:
    rows = []
    for io in ios:
        dims = ", ".join(str(d) for d in io.dims)
        opt = "\n    optional: true" if io.optional else ""
        rows.append(f'  {{\n    name: "{io.name}"\n    data_type: TYPE_{io.dtype}\n'
                    f'    dims: [ {dims} ]{opt}\n  }}')
    return f"{kind} [\n" + ",\n".join(rows) + "\n]\n"


def config_pbtxt(model_name: str) -> str:
    """Decoupled, unbatched by Triton (the engine batches), one CPU instance."""
    return (f'name: "{model_name}"\nbackend: "python"\nmax_batch_size: 0\n\n'
            "model_transaction_policy {\n  decoupled: true\n}\n\n"
            + _io_block("input", INPUTS) + "\n" + _io_block("output", OUTPUTS) + "\n"
            "instance_group [\n  {\n    count: 1\n    kind: KIND_CPU\n  }\n]\n")


def deploy(engine_path, out_repo, model_name: str = "trtkv", api: str = "trtkv.api") -> Path:
    """Write `<out_repo>/<model_name>/`; returns that model directory.

    `api` names the module providing `Engine` and `SamplingParams` (tests use
    a fake one); the engine path is stored absolute so the repository can be
    served from anywhere on this machine.
    """
    if (Path(engine_path) / "engine.json").is_file():
        from trtkv.artifacts.engine_dir import read_manifest
        from trtkv.errors import TrtkvError

        tp = read_manifest(engine_path).model.tp
        if tp > 1:  # the Python backend's model instance is one process; `trtkv serve` starts the ranks
            raise TrtkvError(f"{engine_path} runs on {tp} tensor-parallel ranks, and a deployed Triton model on one "
                             f"process: serve it with `trtkv serve {engine_path}`, or build it with --tp 1")
    model_dir = Path(out_repo) / model_name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.pbtxt").write_text(config_pbtxt(model_name))
    (model_dir / "1" / "model.py").write_text(MODEL_PY)
    spec = {"engine": str(Path(engine_path).resolve()), "api": api}
    (model_dir / "model.json").write_text(json.dumps(spec, indent=2) + "\n")
    return model_dir


def _pytriton_dist() -> Path:
    import pytriton

    return Path(pytriton.__file__).parent / "tritonserver"


def tritonserver_binary() -> Path:
    return _pytriton_dist() / "bin" / "tritonserver"


def prepare_backends(dest=None) -> Path:
    """A `--backend-directory` whose python backend has this Python's stub."""
    import pytriton

    dist = _pytriton_dist()
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if dest is None:
        cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        dest = cache / "trtkv" / f"triton-backends-pytriton{pytriton.__version__}-py{version}"
    dest = Path(dest)
    python = dest / "python"
    stub = dist / "python_backend_stubs" / version / "triton_python_backend_stub"
    if not stub.exists():
        raise RuntimeError(f"nvidia-pytriton has no Python-backend stub for Python {version}")
    if not (python / "triton_python_backend_stub").exists():
        python.mkdir(parents=True, exist_ok=True)
        for src in (dist / "backends" / "python").iterdir():
            if src.is_file():
                shutil.copy2(src, python / src.name)
        shutil.copy2(stub, python / stub.name)
    return dest


def tritonserver_env(base=None) -> dict:
    env = dict(os.environ if base is None else base)

    def prepend(key, value):
        parts = [p for p in env.get(key, "").split(os.pathsep) if p and p != value]
        env[key] = os.pathsep.join([value, *parts])

    import pytriton

    prepend("LD_LIBRARY_PATH", str(Path(pytriton.__file__).parent.parent / "nvidia_pytriton.libs"))
    prepend("LD_LIBRARY_PATH", sysconfig.get_config_var("LIBDIR"))
    prepend("PATH", str(Path(sys.prefix) / "bin"))
    source_root = str(Path(__file__).resolve().parents[2])
    if source_root not in {str(Path(p).resolve()) for p in sysconfig.get_paths().values()}:
        prepend("PYTHONPATH", source_root)
    return env


def tritonserver_command(repo, host="127.0.0.1", http_port=8000, grpc_port=8001,
                         metrics_port=8002, backends=None, extra=(), open_apis=(), allow_http=True,
                         shm_prefix="trtkv-") -> list[str]:
    """tritonserver's argv: no model control, closed admin APIs (see restrictions.py)."""
    http_rule, grpc_rule = http_restriction(open_apis), grpc_restriction(open_apis)
    return [str(tritonserver_binary()), f"--model-repository={Path(repo).resolve()}",
            f"--backend-directory={prepare_backends(backends)}",
            "--model-control-mode=none",
            f"--allow-http={'true' if allow_http else 'false'}",
            f"--http-address={host}", f"--http-port={http_port}",
            f"--grpc-address={host}", f"--grpc-port={grpc_port}",
            f"--metrics-address={host}", f"--metrics-port={metrics_port}",
            f"--backend-config=python,shm-region-prefix-name={shm_prefix}",
            *([f"--http-restricted-api={http_rule}"] if http_rule and allow_http else []),
            *([f"--grpc-restricted-protocol={grpc_rule}"] if grpc_rule else []),
            "--exit-timeout-secs=10", *extra]


def _child_setup() -> None:
    """In the child before exec: private files (/dev/shm regions hold prompts), die with the parent."""
    import ctypes
    import signal

    os.umask(0o077)
    PR_SET_PDEATHSIG = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


class TritonProcess:
    """A tritonserver on a repository and everything it leaves behind.

    tritonserver runs in its own session (a terminal's Ctrl-C reaches only the caller, which
    forwards one SIGINT: a second makes Triton exit at once); its Python-backend stubs are in that
    session's process group, so `cleanup` can kill any it orphaned (a crashed tritonserver leaves a
    1 GB stub that ignores SIGTERM) and remove the `/dev/shm` regions named by this run's prefix.
    """

    def __init__(self, repo, env=None, **kwargs):
        self.shm_prefix = f"trtkv-{os.getpid()}-{uuid.uuid4().hex[:8]}-"
        self.drain_file = Path(tempfile.mkdtemp(prefix="trtkv-drain-")) / "drain"
        env = {**tritonserver_env(env), DRAIN_ENV: str(self.drain_file)}
        self.proc = subprocess.Popen(tritonserver_command(repo, shm_prefix=self.shm_prefix, **kwargs),
                                     env=env, start_new_session=True, preexec_fn=_child_setup)
        self.pid = self.proc.pid

    def __getattr__(self, name):  # poll, wait, send_signal, returncode, ... of the Popen
        return getattr(self.proc, name)

    def drain(self) -> None:
        """Ask the model to end its open streams with an error response (see triton_model.py)."""
        self.drain_file.touch()

    def cleanup(self) -> list[str]:
        """Kill leftover processes of the group and remove this run's shared memory; what was left."""
        import signal

        left = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
            left.append(f"process group {self.proc.pid}")
        except (ProcessLookupError, PermissionError):
            pass
        left += [str(p) for p in shm.remove(self.shm_prefix)]
        shutil.rmtree(self.drain_file.parent, ignore_errors=True)
        return left

    def protect(self) -> None:
        """Take others' access to this server's /dev/shm regions (call at start and periodically)."""
        shm.make_private(self.shm_prefix)


def start_tritonserver(repo, env=None, **kwargs) -> TritonProcess:
    """Start tritonserver on a repository; stop it with `.send_signal(SIGINT)`, then `.cleanup()`."""
    return TritonProcess(repo, env, **kwargs)
