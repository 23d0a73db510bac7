"""The Serve application's import path, for `serve run` and a KubeRay RayService:

    import_path: memra_dist.serve.entry:app_builder
    args: {model: /models/llama, pp: 2, sessions: 4, max-queue: 32, trace-level: 1}

`args` are `memra-dist serve`'s flags (dashes or underscores; true = a bare flag), checked as
the CLI checks them; HTTP host and port are the Serve config's `http_options`, not these.
(Its own module: it reads the CLI's flag set, and nothing the CLI imports may import it.)"""

from __future__ import annotations

from ..cli import _add_run_args
from ..errors import UserError
from .deployment import build
from .serve_cli import parse_serve_argv, spec_argv

__all__ = ["app_builder"]


def app_builder(spec: dict | None = None):
    """The application of one engine replica; ValueError (Serve shows it) for bad args."""
    try:
        args = parse_serve_argv(spec_argv(dict(spec or {})), _add_run_args)
    except UserError as e:
        raise ValueError(str(e)) from None
    return build(args)
