"""Which tritonserver API categories trtkv closes, and the flags that close them.

tritonserver cannot switch an API category off; it can only demand a header (`key=value`) on it,
given on its command line, which every local user can read in /proc/<pid>/cmdline.  A header that
no client can send closes a category for everyone, whoever reads the command line:

* gRPC: the key has upper-case letters; HTTP/2 (and so gRPC) metadata keys are lower-case only,
  and gRPC clients refuse to send others;
* HTTP: the value holds a line break, which cannot appear in an HTTP/1.1 header value.

Nothing in trtkv needs these categories: `trtkv serve` loads its model at tritonserver's startup
(no model-repository API), and the deployed repository runs with `--model-control-mode=none`.
`--open-api CATEGORY` leaves a category open (unrestricted) for who really needs it.
"""

from __future__ import annotations

from trtkv.errors import TrtkvError

CATEGORIES = ("health", "metadata", "inference", "shared-memory", "model-config", "model-repository",
              "statistics", "trace", "logging")
# Closed unless opened: shared memory (a client can map the backend's own regions and abort the
# server), the repository (load with an uploaded model.py runs code), statistics, trace, logging
# (a client could turn verbose logging on and fill the disk with every prompt).
CLOSED_DEPLOYED = ("shared-memory", "model-repository", "statistics", "trace", "logging")
# PyTriton reads the log settings while it starts; `trtkv serve` skips that check (triton_server._triton_class).
CLOSED_PYTRITON = CLOSED_DEPLOYED
GRPC_KEY, GRPC_VALUE = "TRTKV-CLOSED", "unsendable-upper-case-key"
HTTP_KEY, HTTP_VALUE = "trtkv-closed", "unsendable\nline-break"


def closed(open_apis=(), pytriton: bool = False) -> tuple[str, ...]:
    unknown = sorted(set(open_apis) - set(CATEGORIES))
    if unknown:
        raise TrtkvError(f"unknown Triton API category {', '.join(unknown)}; "
                         f"choose from {', '.join(CATEGORIES)}")
    return tuple(c for c in (CLOSED_PYTRITON if pytriton else CLOSED_DEPLOYED) if c not in open_apis)


def grpc_restriction(open_apis=(), pytriton: bool = False) -> str | None:
    cats = closed(open_apis, pytriton)
    return f"{','.join(cats)}:{GRPC_KEY}={GRPC_VALUE}" if cats else None


def http_restriction(open_apis=()) -> str | None:
    cats = closed(open_apis)
    return f"{','.join(cats)}:{HTTP_KEY}={HTTP_VALUE}" if cats else None
