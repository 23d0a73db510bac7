"""Every documented command once, each in a fresh process, as a user runs it: the installed
`memra-dist` (next to this Python, else `python -m memra_dist.cli`), default flags plus
`--device`; a table of command, exit code, seconds to the first token and decode tok/s.
Run it on a GPU whenever a change touches the CUDA path (its table goes in BENCHMARKS.md).

Rows (`--only` picks groups):
  demo      `memra-dist demo --drafter X` for none, ngram, model, dflash, mtp, eagle3: the
            demo's own models, built once into MEMRA_CACHE_DIR (the work dir unless --keep-cache)
  generate  `generate --json` on tiny random checkpoints of llama, qwen2, qwen3, kimi_linear,
            deepseek_v3, glm4_moe (memra_dist/bench/tiny_families.py, saved by transformers)
            with each drafter the family takes (none, ngram, model, dflash, eagle3; mtp on
            deepseek_v3 / glm4_moe, their MTP layers); `--families` narrows
  compile   `generate --json --compile on` once per family (mtp where it has MTP layers, else ngram)
  bench     `bench --quick` (`--budget-s`: --bench-budget-s, default 480; 150 on CPU)
  serve     `serve` on a free port; one streamed completion timed from here (http.client)
  batch     `batch` of three lines, one at a time and with `--max-batch 3` (one batched engine);
            glm4_moe's with `--drafter mtp --max-batch 3` (MTP's rounds on the loop's pool graphs)
  pp2       `--pp 2` (generate llama ngram / dflash, glm4_moe mtp, kimi_linear eagle3; batch):
            only with >= 2 CUDA devices, or `--pp2-cpu` (a local Ray on the CPU)
Figures come from each command's own output: `--json` stats (ttft_ms, tok_per_s), the demo's
`[memra] ... tok/s=... ttft_ms=...` line, batch's records (the first request's ttft_ms) and its
`[batch] done:` line (the job's tok/s, prefills included), serve's stream as this script
receives it (first chunk with text; (tokens - 1) over first to last chunk), bench's
decode.plain.tok_s.

    python benchmarks/smoke_commands.py [--device cuda|cpu] [--quick] [--only demo,generate]
        [--work DIR] [--out smoke.json] [--timeout 600] [--pp2-cpu] [--keep-cache]
Prints the markdown table on stdout (progress on stderr), writes JSON with --out, keeps each
command's stdout / stderr under WORK/logs/; exit 1 when any row failed (skipped rows do not).
Where a call has a wall limit (the GPU machine's 10 minutes), run it in parts with one --work:
`--only demo`, `--only generate,serve,batch`, `--only bench`, `--only pp2` (checkpoints and
caches are reused)."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from memra_dist.bench.smoke import (last_json, markdown_table, parse_batch_summary, parse_summary,  # noqa: E402
                                    run_cmd, stop_group, stream_completion, wait_health)

GROUPS = ("demo", "generate", "compile", "bench", "serve", "batch", "pp2")
DEMO_DRAFTERS = ("none", "ngram", "model", "dflash", "mtp", "eagle3")
PROMPT = "The phase clock drains the streams of every engine that ran a phase"
BATCH_PROMPTS = ("A pipeline splits the layers of the model", "Every phase of every round becomes a span",
                 "The drafter proposes a few tokens")


def _say(*a) -> None:
    print("[smoke]", *a, file=sys.stderr, flush=True)


def memra_cmd() -> tuple[list[str], bool]:
    """The installed console script next to this Python, else the module (and whether the
    repo must go on PYTHONPATH)."""
    exe = Path(sys.executable).with_name("memra-dist")
    if exe.exists():
        return [str(exe)], False
    return [sys.executable, "-m", "memra_dist.cli"], True


def child_env(work: Path, keep_cache: bool, on_path: bool) -> dict:
    """This environment without what would redirect a command (OTLP, a Ray cluster, a caller's
    trace, memra settings), with the demo / bench caches in the work dir unless keep_cache."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OTEL_", "MEMRA_", "TRACEPARENT")) and k != "RAY_ADDRESS"}
    keep = {k: os.environ[k] for k in ("MEMRA_CACHE_DIR", "MEMRA_BENCH_CACHE") if keep_cache and k in os.environ}
    env.update(keep)
    if not keep_cache:
        env["MEMRA_CACHE_DIR"] = str(work / "cache")
        env["MEMRA_BENCH_CACHE"] = str(work / "bench-cache")
    env.setdefault("TOKENIZERS_PARALLELISM", "false")
    if on_path:
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tail(s: str, n: int = 3) -> str:
    s = re.sub(r"\x1b\[[0-9;]*m", "", s)  # Ray's colours
    lines = [ln.strip() for ln in s.strip().splitlines() if ln.strip() and "it/s]" not in ln]
    return " / ".join(lines[-n:])[-400:]


class Smoke:
    def __init__(self, a, work: Path):
        self.a, self.work = a, work
        self.exe, on_path = memra_cmd()
        self.env = child_env(work, a.keep_cache, on_path)
        self.rows: list[dict] = []
        self.new = ["--max-new-tokens", "16"] if a.quick else []
        (work / "logs").mkdir(parents=True, exist_ok=True)
        self.families: dict[str, dict | str] = {}

    # ---- one row --------------------------------------------------------------------------

    def add(self, name: str, argv: list[str], kind: str, timeout: float | None = None, **extra) -> dict:
        """Run `memra-dist argv` in a fresh process and read its figures; kind: how (demo |
        json | bench | batch)."""
        i = len(self.rows) + 1
        stem = str(self.work / "logs" / f"{i:02d}-{name.replace(' ', '_').replace('/', '_')[:60]}")
        _say(f"{i:02d} {name} ...")
        r = run_cmd(self.exe + argv, self.env, str(self.work), timeout or self.a.timeout, stem)
        row = {"name": name, "argv": argv, "rc": r["rc"], "wall_s": r["wall_s"], "ttft_s": None,
               "tok_per_s": None, "ok": False, "note": "", **extra}
        try:
            getattr(self, f"_read_{kind}")(row, r)
        except Exception as e:  # noqa: BLE001 (a figure we cannot read is the row's note)
            row["note"] = f"unreadable output: {type(e).__name__}: {e}"
        if r["rc"] != 0:
            row["ok"] = False
            row["note"] = (row["note"] + "; " if row["note"] else "") + _tail(r["err"] or r["out"])
        row["note"] = (row["note"] + f"; wall {r['wall_s']:.1f} s").lstrip("; ")
        self._done(row)
        return row

    def _done(self, row: dict) -> None:
        self.rows.append(row)
        _say(f"   exit {row['rc']} ok={row['ok']} first token {row['ttft_s']} s, {row['tok_per_s']} tok/s; "
             f"{row['note']}")

    def skip(self, name: str, why: str) -> None:
        self.rows.append({"name": name, "rc": None, "ok": None, "ttft_s": None, "tok_per_s": None,
                          "note": f"skipped: {why}"})
        _say(f"{len(self.rows):02d} {name}: skipped ({why})")

    @staticmethod
    def _stats(row: dict, st: dict | None, extra: str = "") -> None:
        if not st:
            row["note"] = "no figures in the output"
            return
        row["ttft_s"] = round(st["ttft_ms"] / 1e3, 4) if st.get("ttft_ms") is not None else None
        row["tok_per_s"] = st.get("tok_per_s")
        acc = st.get("acceptance") if st.get("drafted") else None  # no drafts (none): no acceptance
        row["note"] = ", ".join(x for x in (f"{st.get('tokens')} tokens",
                                            f"acceptance {acc:.2f}" if isinstance(acc, float) else "", extra) if x)
        row["ok"] = row["rc"] == 0 and (st.get("tokens") or 0) > 0

    def _read_demo(self, row, r) -> None:
        st = parse_summary(r["out"])
        self._stats(row, st, f"path={st['path']}" if st and "path" in st else "")

    def _read_json(self, row, r) -> None:
        d = last_json(r["out"]) or {}
        st = d.get("stats")
        path = (st or {}).get("fast_path") or {}
        self._stats(row, st, "path=" + "+".join(k for k, v in path.items() if v) if any(path.values()) else "")

    def _read_bench(self, row, r) -> None:
        f = self.work / "bench" / "bench.json"
        d = json.loads(f.read_text()) if f.exists() else {}
        plain = (d.get("decode") or {}).get("plain") or {}
        row["tok_per_s"] = plain.get("tok_s")
        meta = d.get("meta") or {}
        budget = [k for k, v in d.items() if isinstance(v, dict) and v.get("skipped") == "budget"]
        errors = [k for k, v in d.items() if isinstance(v, dict) and v.get("error")]
        row["note"] = (f"shape {meta.get('shape')}, plain decode (bench has no first-token figure)"
                       + (f"; past the budget: {', '.join(budget)}" if budget else "")
                       + (f"; ERRORS in {', '.join(errors)}" if errors else ""))
        row["ok"] = row["rc"] == 0 and bool(plain) and not errors

    def _read_batch(self, row, r) -> None:
        summ = parse_batch_summary(r["err"]) or {}
        out = Path(row["output"])
        recs = [json.loads(ln) for ln in out.read_text().splitlines() if ln.strip()] if out.exists() else []
        good = [x for x in recs if "stats" in x]
        row["ttft_s"] = round(good[0]["stats"]["ttft_ms"] / 1e3, 4) if good else None
        row["tok_per_s"] = summ.get("tok_per_s")
        row["note"] = f"{len(good)}/{len(BATCH_PROMPTS)} records, {summ.get('tokens')} tokens"
        row["ok"] = row["rc"] == 0 and len(good) == len(BATCH_PROMPTS) and bool(summ)

    # ---- groups ---------------------------------------------------------------------------

    def dev(self) -> list[str]:
        return ["--device", self.a.device]

    def demo(self) -> None:
        for d in DEMO_DRAFTERS:
            self.add(f"demo --drafter {d}", ["demo", "--drafter", d, *self.dev(), *self.new], "demo")

    def family(self, arch: str) -> dict | str:
        """The family's checkpoints (built once), or why they cannot be."""
        if arch not in self.families:
            from memra_dist.bench.tiny_families import build_family  # noqa: PLC0415

            try:
                from transformers.utils import logging as hf_logging  # noqa: PLC0415

                hf_logging.disable_progress_bar()
                t0 = time.perf_counter()
                self.families[arch] = {k: str(v) for k, v in build_family(arch, self.work / "ckpt" / arch).items()}
                _say(f"built the tiny {arch} checkpoints in {time.perf_counter() - t0:.1f} s")
            except ImportError as e:
                self.families[arch] = f"cannot build {arch} checkpoints: {e}"
        return self.families[arch]

    def gen_argv(self, arch: str, drafter: str, ck: dict, pp: int = 1) -> list[str]:
        argv = ["generate", "--model", ck["target"], "--prompt", PROMPT, "--drafter", drafter, "--json",
                *self.dev(), *self.new]
        if drafter in ("model", "dflash", "eagle3"):
            argv += ["--draft-model", ck["draft" if drafter == "model" else drafter]]
        return argv + (["--pp", str(pp)] if pp > 1 else [])

    def generate(self) -> None:
        from memra_dist.bench.tiny_families import DRAFTERS  # noqa: PLC0415

        for arch in self.a.families:
            ck = self.family(arch)
            for d in DRAFTERS[arch]:
                name = f"generate {arch} --drafter {d}"
                if isinstance(ck, str):
                    self.skip(name, ck)
                else:
                    self.add(name, self.gen_argv(arch, d, ck), "json")

    def compile(self) -> None:
        """`generate --compile on` once per family, with the drafter that compiles the most of it:
        mtp where the family has MTP layers (its MoE blocks and MTP layers compiled), else ngram."""
        from memra_dist.bench.tiny_families import DRAFTERS  # noqa: PLC0415

        for arch in self.a.families:
            ck = self.family(arch)
            d = "mtp" if "mtp" in DRAFTERS[arch] else "ngram"
            name = f"generate {arch} --drafter {d} --compile on"
            if isinstance(ck, str):
                self.skip(name, ck)
            else:
                self.add(name, self.gen_argv(arch, d, ck) + ["--compile", "on"], "json")

    def bench(self) -> None:
        budget = self.a.bench_budget_s or (150 if self.a.device == "cpu" else 480)
        (self.work / "bench").mkdir(exist_ok=True)
        self.add("bench --quick", ["bench", "--quick", *self.dev(), "--budget-s", str(budget), "--out",
                                   str(self.work / "bench" / "bench.json")], "bench", timeout=budget + 300)

    def batch(self) -> None:
        self._batch()
        self._batch(max_batch=3)  # the three lines in one batched engine (batching/)
        self._batch(max_batch=3, arch="glm4_moe", drafter="mtp")  # MTP's rounds on the loop's pool graphs

    def _batch(self, pp: int = 1, max_batch: int = 1, arch: str = "llama", drafter: str | None = None) -> None:
        name = f"batch {arch} --pp {pp}" if pp > 1 else f"batch {arch}"
        name += f" --drafter {drafter}" if drafter else ""
        name += f" --max-batch {max_batch}" if max_batch > 1 else ""
        ck = self.family(arch)
        if isinstance(ck, str):
            return self.skip(name, ck)
        d = (self.work / "batch" / (f"pp{pp}" if pp > 1 else arch) / (drafter or "")
             / (f"b{max_batch}" if max_batch > 1 else ""))
        d.mkdir(parents=True, exist_ok=True)
        (d / "results.jsonl").unlink(missing_ok=True)  # a fresh job, not a resumed one
        (d / "prompts.jsonl").write_text("".join(json.dumps({"id": i + 1, "prompt": p}) + "\n"
                                                 for i, p in enumerate(BATCH_PROMPTS)))
        self.add(name, ["batch", "--model", ck["target"], "--input", str(d / "prompts.jsonl"), "--output",
                        str(d / "results.jsonl"), *self.dev(), *self.new] + (["--pp", str(pp)] if pp > 1 else [])
                 + (["--max-batch", str(max_batch)] if max_batch > 1 else []) + (["--drafter", drafter] if drafter else []),
                 "batch", output=str(d / "results.jsonl"))

    def serve(self) -> None:
        name = "serve llama + one streamed request"
        ck = self.family("llama")
        if isinstance(ck, str):
            return self.skip(name, ck)
        port = free_port()
        argv = ["serve", "--model", ck["target"], "--port", str(port), *self.dev()]
        _say(f"{len(self.rows) + 1:02d} {name} (port {port}) ...")
        stem = self.work / "logs" / f"{len(self.rows) + 1:02d}-serve"
        t0 = time.perf_counter()
        with open(f"{stem}.out", "w") as out, open(f"{stem}.err", "w") as err:
            p = subprocess.Popen(self.exe + argv, env=self.env, cwd=str(self.work), stdout=out, stderr=err,
                                 start_new_session=True)
            row = {"name": name, "argv": argv, "rc": None, "ttft_s": None, "tok_per_s": None, "ok": False, "note": ""}
            try:  # up = its own "Ctrl-C stops" line (deploy returned), then /health answering
                up = _wait_line(Path(f"{stem}.err"), "Ctrl-C stops", p, self.a.timeout) and \
                    wait_health(port, p, 60) is not None
                ready = time.perf_counter() - t0
                if not up:
                    row["note"] = "the server exited before it was up" if p.poll() is not None else \
                        f"not up (its 'Ctrl-C stops' line, then /health) within {self.a.timeout:.0f} s"
                else:
                    body = {"prompt": PROMPT, "temperature": 0, **({"max_tokens": 16} if self.a.quick else {})}
                    s = stream_completion(port, body, self.a.timeout)
                    row.update(ttft_s=s["ttft_s"], tok_per_s=s["tok_per_s"], stream=s)
                    row["note"] = (s["error"] or f"{s['tokens']} tokens in {s['chunks']} chunks") + \
                        f"; healthy after {ready:.1f} s; timed from outside"
                    row["ok"] = s["error"] is None and s["tokens"] > 0
            finally:
                row["rc"] = stop_group(p)
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        row["ok"] = row["ok"] and row["rc"] == 0
        if row["rc"] != 0 or not row["ok"]:
            row["note"] += "; " + _tail(Path(f"{stem}.err").read_text())
        row["note"] += f"; wall {row['wall_s']:.1f} s (exit after SIGTERM)"
        self._done(row)

    def pp2(self) -> None:
        if self.a.cuda_devices < 2 and not self.a.pp2_cpu:
            return self.skip("--pp 2 rows", f"{self.a.cuda_devices} CUDA device(s); --pp2-cpu runs them on the CPU")
        for arch, d in (("llama", "ngram"), ("llama", "dflash"), ("glm4_moe", "mtp"), ("kimi_linear", "eagle3")):
            name = f"generate {arch} --drafter {d} --pp 2"
            if arch not in self.a.families:
                continue
            ck = self.family(arch)
            if isinstance(ck, str):
                self.skip(name, ck)
            else:
                self.add(name, self.gen_argv(arch, d, ck, pp=2), "json")
        self._batch(pp=2)


def _wait_line(path: Path, marker: str, proc: subprocess.Popen, timeout_s: float) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end and proc.poll() is None:
        if marker in path.read_text(errors="replace"):
            return True
        time.sleep(0.5)
    return False


def _commit() -> str:
    try:
        c = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                           timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
        return c + ("-dirty" if dirty else "") if c else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def parse_args(argv=None):
    from memra_dist.bench.tiny_families import FAMILIES  # noqa: PLC0415

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default=None, help="passed to every command (default: cuda when available, else cpu)")
    ap.add_argument("--only", default=",".join(GROUPS), help=f"comma list of {','.join(GROUPS)} (default: all)")
    ap.add_argument("--families", default=",".join(FAMILIES), help="generate rows: comma list (default: all six)")
    ap.add_argument("--quick", action="store_true", help="16 new tokens a request (demo, generate, serve, batch)")
    ap.add_argument("--work", help="work dir: checkpoints, caches, logs; reused when given "
                                   "(default: a new temp dir, removed when no row failed)")
    ap.add_argument("--out", help="write the rows as JSON here")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per command (default 600)")
    ap.add_argument("--bench-budget-s", type=float, default=None, help="bench --budget-s (default 480; CPU 150)")
    ap.add_argument("--pp2-cpu", action="store_true", help="run the --pp 2 rows without 2 CUDA devices")
    ap.add_argument("--keep-cache", action="store_true", help="the demo / bench caches where they are (not in --work)")
    a = ap.parse_args(argv)
    import torch  # noqa: PLC0415 (only to pick the device)

    a.cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    a.device = a.device or ("cuda" if a.cuda_devices else "cpu")
    a.only = [g.strip() for g in a.only.split(",") if g.strip()]
    a.families = [f.strip() for f in a.families.split(",") if f.strip()]
    bad = [g for g in a.only if g not in GROUPS] + [f for f in a.families if f not in FAMILIES]
    if bad:
        ap.error(f"unknown: {', '.join(bad)}")
    if "pp2" in a.only and a.device == "cpu" and a.cuda_devices >= 2 and not a.pp2_cpu:
        a.cuda_devices = 0  # --device cpu: the pp rows need --pp2-cpu
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    work = Path(a.work).resolve() if a.work else Path(tempfile.mkdtemp(prefix="memra-smoke-"))
    work.mkdir(parents=True, exist_ok=True)
    s = Smoke(a, work)
    _say(f"work dir {work}; device {a.device}; {a.cuda_devices} CUDA device(s); running {' '.join(s.exe)}")
    t0 = time.perf_counter()
    for g in GROUPS:
        if g in a.only:
            getattr(s, g)()
    total = time.perf_counter() - t0
    failed = [r for r in s.rows if r["ok"] is False]
    meta = {"date": datetime.datetime.now().strftime("%Y-%m-%d %H:%M"), "device": a.device,
            "cuda_devices": a.cuda_devices, "commit": _commit(), "quick": a.quick, "work": str(work),
            "command": " ".join(s.exe), "python": sys.version.split()[0], "total_s": round(total, 1),
            "rows": len(s.rows), "failed": len(failed), "host_cpus": os.cpu_count()}
    try:
        import torch  # noqa: PLC0415

        meta["torch"] = torch.__version__
        if a.cuda_devices:
            meta["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    print(markdown_table(s.rows))
    print(f"\n{len(s.rows)} rows, {len(failed)} failed, {total:.0f} s; device {a.device}, commit {meta['commit']}")
    if a.out:
        Path(a.out).write_text(json.dumps({"meta": meta, "rows": s.rows}, indent=1))
    if not a.work and not failed:
        shutil.rmtree(work, ignore_errors=True)  # a temp dir that told nothing: gone (failures keep their logs)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
