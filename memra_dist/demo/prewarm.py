"""The demo's kernels compiled while its models train (issue: a fresh machine's first token).

On a fresh GPU machine the demo's first command used to spend ~5 s of its first token compiling
the engine's Triton kernels, after ~10 s of training its models on the CPU with the GPU idle.
The kernels depend on the models' shapes, not their weights, and Triton keeps what it compiles
in its on-disk cache, shared by every process of the user. So as soon as the tokenizer (hence
every shape) is known, `start` writes untrained checkpoints of the demo's shapes into a scratch
directory and runs the same command on them in a child process (`memra-dist generate`, the
user's device, drafter and engine flags, its output discarded) while this process trains; `join`
waits for it (bounded) before the real engine opens, which then finds its kernels compiled. The
child's graph captures are its own (a graph does not outlive its process), so the first token
still pays those (~0.5 s for the demo).

Nothing happens where nothing compiles: on a CPU, with --kernels off, or when the models are
already built (a second run: Triton's cache is warm by then). A child that fails or overruns
costs the demo nothing but the wait: the real engine compiles what is missing itself.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

__all__ = ["Prewarm", "wanted", "warm_command"]

JOIN_S = 60.0  # the longest the demo waits for the child once its models are built
WARM_DRAFTERS = ("none", "ngram", "model")  # the rest warm the target's kernels through `model`


def wanted(args) -> bool:
    """A CUDA device that compiles kernels: where the child's compiles pay."""
    if getattr(args, "kernels", "auto") == "off":
        return False
    dev = str(getattr(args, "device", "auto") or "auto")
    if dev.startswith("cpu"):
        return False
    import torch  # noqa: PLC0415

    return torch.cuda.is_available()


def warm_command(args, target: Path, draft: Path, prompt: str) -> list[str]:
    """The child's command line: the demo's generate on the untrained checkpoints, with the
    user's device and engine flags, no trace, no output."""
    drafter = args.drafter if args.drafter in WARM_DRAFTERS else "model"
    cmd = [sys.executable, "-m", "memra_dist.cli", "generate", "--model", str(target), "--prompt", prompt,
           "--drafter", drafter, "-k", str(args.k), "--max-new-tokens", str(args.max_new_tokens),
           "--device", str(args.device), "--trace-level", "0", "--json"]
    if drafter == "model":
        cmd += ["--draft-model", str(draft)]
    for flag in ("graphs", "compile", "kernels"):
        val = getattr(args, flag, None)
        if val is not None:
            cmd += [f"--{flag}", str(val)]
    return cmd


class Prewarm:
    """The child compiling the demo's kernels (see the module doc)."""

    def __init__(self, args, prompt: str, say=None):
        self.args, self.prompt, self.say = args, prompt, say or (lambda s: None)
        self.proc: subprocess.Popen | None = None
        self.dir: str | None = None
        self.t0 = 0.0

    def start(self, shapes: dict[str, dict], tok) -> None:
        """`shapes`: the demo's {"target": cfg, "draft": cfg} (llama_config dicts); `tok` its tokenizer."""
        from .tiny import build_checkpoint  # noqa: PLC0415

        self.dir = tempfile.mkdtemp(prefix="memra-demo-warm-")
        paths = {name: build_checkpoint(Path(self.dir) / name, cfg, tok, seed=7) for name, cfg in shapes.items()}
        env = dict(os.environ)
        env.pop("OTEL_EXPORTER_OTLP_ENDPOINT", None)  # the child's spans are nobody's
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(warm_command(self.args, Path(paths["target"]), Path(paths["draft"]), self.prompt),
                                     stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        self.say("compiling the engine's kernels for the demo's shapes meanwhile (a child process)")

    def join(self, timeout: float = JOIN_S) -> int | None:
        """Wait for the child (at most `timeout` s, then stop it); its exit code (None: stopped)."""
        if self.proc is None:
            return None
        try:
            rc = self.proc.wait(timeout=timeout)
            self.say(f"kernels compiled in the child in {time.perf_counter() - self.t0:.1f}s (exit {rc})")
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            rc = None
            self.say(f"the kernels' child overran {timeout:.0f}s: stopped (the engine compiles what it lacks)")
        finally:
            self.close()
        return rc

    def close(self) -> None:
        """Stop the child if it still runs; remove its checkpoints."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            self.dir = None
