"""Run one of upstream Twinkle's cookbook client scripts, unmodified but for the marked
substitutions in tests/compat/substitutions.py, against a running `twinkle serve`, offline.

    python -m tests.compat.run_upstream tinker/self_cognition --server URL --key KEY
    python -m tests.compat.run_upstream --list

The script is read at run time from an upstream checkout (never stored in this repo):
TWINKLE_UPSTREAM_REPO names a bare repo / git dir (read with `git show <ref>:<path>`, ref from
TWINKLE_UPSTREAM_REF, default UPSTREAM_REF below) or a normal checkout (its files as they are).
Default: /work/.mirror/modelscope+twinkle/repo. It runs with the python of the compat venv
(tests/compat/venv.py: twinkle-kit 0.5.1 + tinker 0.16.1) in a fresh temp dir, output streamed.
Exit code: the script's; 2 when the harness itself cannot run it (no checkout, a substitution
that no longer matches, no compat venv).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from tests.compat.substitutions import NEEDS_CHECKPOINT, SCRIPTS, Sub

REPO = Path(__file__).resolve().parents[2]
DATA = Path(__file__).resolve().parent / "data"
MODEL_NAME = "twinkle/tiny-chat"
DEFAULT_UPSTREAM = "/work/.mirror/modelscope+twinkle/repo"
# The upstream commit the substitutions were written against (main, 2026-07-22). Override with
# TWINKLE_UPSTREAM_REF (e.g. HEAD) to try a newer one.
UPSTREAM_REF = "1a1d8845dc6de05c7957bada323b0cc5c5e90f35"
SCRIPT_TIMEOUT_S = 600


class HarnessError(RuntimeError):
    """The harness cannot run the script (as opposed to the script failing)."""


# ------------------------------------------------------------------ fetching the script


def upstream_location() -> str:
    return os.environ.get("TWINKLE_UPSTREAM_REPO", DEFAULT_UPSTREAM)


def _candidate_paths(script_id: str) -> list[str]:
    kind, name = script_id.split("/", 1)
    # Current layout first, then the older self_host/ one.
    return [f"cookbook/client/{kind}/{name}.py", f"cookbook/client/{kind}/self_host/{name}.py"]


def _is_git_dir(path: Path) -> bool:
    return (path / "HEAD").is_file() and (path / "objects").is_dir()


def fetch_script(script_id: str, location: str | None = None) -> tuple[str, str]:
    """(source text, where it came from). Raises HarnessError when unavailable."""
    loc = Path(location or upstream_location())
    if not loc.exists():
        raise HarnessError(f"no upstream checkout at {loc} (set TWINKLE_UPSTREAM_REPO)")
    if _is_git_dir(loc):
        ref = os.environ.get("TWINKLE_UPSTREAM_REF", UPSTREAM_REF)
        for rel in _candidate_paths(script_id):
            out = subprocess.run(
                ["git", "--git-dir", str(loc), "show", f"{ref}:{rel}"],
                capture_output=True,
                text=True,
            )
            if out.returncode == 0:
                return out.stdout, f"{loc} @ {ref}:{rel}"
        raise HarnessError(f"{script_id}: none of {_candidate_paths(script_id)} at {loc} @ {ref}")
    for rel in _candidate_paths(script_id):
        if (loc / rel).is_file():
            return (loc / rel).read_text(), str(loc / rel)
    raise HarnessError(f"{script_id}: none of {_candidate_paths(script_id)} under {loc}")


# ------------------------------------------------------------------ substitutions


def apply_substitutions(script_id: str, text: str, values: dict[str, str], log=print) -> str:
    """The script with every substitution applied, each one printed; HarnessError on a miss."""
    subs: list[Sub] = SCRIPTS[script_id]
    for i, sub in enumerate(subs, 1):
        new = sub.new
        for key, value in values.items():
            new = new.replace(f"@@{key}@@", value)
        if "@@" in new:
            raise HarnessError(f"{script_id} substitution {i}: unfilled placeholder in {new!r}")
        if sub.literal:
            n = text.count(sub.old)
            text = text.replace(sub.old, new)
        else:
            pattern = re.compile(sub.old, re.MULTILINE)
            n = len(pattern.findall(text))
            text = pattern.sub(lambda _m, repl=new: repl, text)
        if n != sub.count:
            raise HarnessError(
                f"{script_id} substitution {i} ({sub.why}): {sub.old!r} matched {n} times, "
                f"expected {sub.count}: upstream's script changed (see substitutions.py)"
            )
        log(f"[compat] substitution {i}/{len(subs)}: {sub.old!r} -> {new!r} ({n}x)")
        log(f"[compat]     why: {sub.why}")
    if not subs:
        log("[compat] no substitutions: the script runs as upstream wrote it")
    return text


# ------------------------------------------------------------------ run-time inputs


def tiny_model_dir(repo: Path = REPO) -> Path:
    """The tiny model's HF folder (tokenizer, ChatML template), built once with our own CLI; the
    server builds the same one (same seed) for `twinkle/tiny-chat`."""
    out = repo / ".cache" / "tiny-chat"
    if (out / "tokenizer.json").is_file() and (out / "config.json").is_file():
        return out
    twinkle_cli = Path(sys.executable).parent / "twinkle"
    subprocess.run(
        [str(twinkle_cli), "models", "build-tiny", "--out", str(out)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def make_checkpoints(server_url: str, api_key: str) -> dict[str, str]:
    """A LoRA checkpoint and a sampler checkpoint on the server, for the sample scripts (upstream
    hard-codes paths from its own runs). Made with the project's tinker SDK; paths handed over in
    upstream's `twinkle://` form."""
    import tinker

    sc = tinker.ServiceClient(base_url=server_url, api_key=api_key)
    try:
        tc = sc.create_lora_training_client(base_model=MODEL_NAME, rank=8, seed=7).result()
        weights = tc.save_state("compat-fixture").result().path
        sampler = tc.save_weights_for_sampler("compat-fixture").result().path
    finally:
        with contextlib.suppress(Exception):  # best effort: the session expires anyway
            sc.close("success")

    def as_twinkle(path: str) -> str:
        return re.sub(r"^[a-z]+://", "twinkle://", path)

    return {"ADAPTER": as_twinkle(weights), "SAMPLER_PATH": as_twinkle(sampler)}


def script_env(server_url: str, api_key: str, model_dir: Path, work: Path) -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TWINKLE_", "TINKER_", "HF_", "MODELSCOPE", "VIRTUAL_ENV"))
    }
    env.update(
        TWINKLE_SERVER_URL=server_url,
        TWINKLE_SERVER_TOKEN=api_key,
        TWINKLE_MODEL_ID=MODEL_NAME,
        # upstream's hub alias map: its client-side Template / dataset.set_template resolve
        # `ms://twinkle/tiny-chat` (and the bare id) to the local folder, no hub call
        TWINKLE_MODEL_ID_ALIASES=json.dumps(
            {f"ms://{MODEL_NAME}": str(model_dir), MODEL_NAME: str(model_dir)}
        ),
        TINKER_TELEMETRY="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        HF_DATASETS_OFFLINE="1",
        HF_HOME=str(work / "hf-home"),  # datasets' cache per run: nothing carried between runs
        MODELSCOPE_CACHE=str(work / "modelscope-cache"),
        PYTHONPATH="",
        PYTHONUNBUFFERED="1",
    )
    return env


# ------------------------------------------------------------------ running


FLOWS = Path(__file__).resolve().parent / "flows.py"


def run_flow(python: str, server_url: str, key: str, flow: str, *args: str) -> dict:
    """tests/compat/flows.py ``flow`` with ``python`` (upstream's client venv or ours) against
    a running server; its RESULT line as a dict (an AssertionError with the output if not)."""
    work = Path(tempfile.mkdtemp(prefix=f"flow-{flow}-"))
    try:
        env = script_env(server_url, key, tiny_model_dir(), work)
        env["COMPAT_DATA"], env["TMPDIR"] = str(DATA), str(work)
        proc = subprocess.run(
            [python, str(FLOWS), flow, *args],
            env=env, cwd=work, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
    finally:
        shutil.rmtree(work, ignore_errors=True)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    tail = f"{proc.stdout[-3000:]}\n{proc.stderr[-4000:]}"
    assert proc.returncode == 0 and lines, f"{flow}:\n{tail}"
    return json.loads(lines[-1][7:])


def run_script(
    script_id: str,
    server_url: str,
    api_key: str,
    *,
    python: str | os.PathLike | None = None,
    timeout: float = SCRIPT_TIMEOUT_S,
    keep_dir: bool = False,
    checkpoints: dict[str, str] | None = None,
    log=print,
) -> int:
    """Fetch, substitute and run one script; its output streamed through `log`. Returns its exit
    code (HarnessError when it cannot be run at all)."""
    if script_id not in SCRIPTS:
        raise HarnessError(f"unknown script {script_id!r}; known: {', '.join(SCRIPTS)}")
    text, origin = fetch_script(script_id)
    log(f"[compat] {script_id}: {origin}")
    values = {"DATA": str(DATA)}
    if script_id in NEEDS_CHECKPOINT:
        values.update(checkpoints or make_checkpoints(server_url, api_key))
        log(f"[compat] harness checkpoints: {values['ADAPTER']}, {values['SAMPLER_PATH']}")
    patched = apply_substitutions(script_id, text, values, log=log)
    if python is None:
        from tests.compat.venv import CompatVenvUnavailable, compat_python

        try:
            python = compat_python()
        except CompatVenvUnavailable as exc:
            raise HarnessError(str(exc)) from exc
    model_dir = tiny_model_dir()

    tmp = Path(tempfile.mkdtemp(prefix=f"compat-{script_id.replace('/', '-')}-"))
    script = tmp / "script" / f"{script_id.replace('/', '_')}.py"
    script.parent.mkdir()
    script.write_text(patched)
    work = tmp / "work"  # the working directory: holds twinkle/tiny-chat -> the tiny model
    (work / MODEL_NAME).parent.mkdir(parents=True)
    (work / MODEL_NAME).symlink_to(model_dir, target_is_directory=True)
    env = script_env(server_url, api_key, model_dir, tmp)
    log(f"[compat] running {script} (cwd {work}) with {python}")
    t0 = time.monotonic()
    proc = subprocess.Popen(
        [str(python), str(script)],
        cwd=work,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    timed_out = threading.Event()

    def _kill() -> None:
        if proc.poll() is None:
            timed_out.set()
            os.killpg(proc.pid, signal.SIGKILL)

    watchdog = threading.Timer(timeout, _kill)  # also when the script hangs without output
    watchdog.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            log(line.rstrip("\n"))
        rc = proc.wait()
    finally:
        watchdog.cancel()
        if proc.poll() is None:  # interrupted (e.g. KeyboardInterrupt): leave nothing behind
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    if timed_out.is_set():
        log(f"[compat] {script_id}: killed after {timeout:.0f} s")
        rc = 124
    log(f"[compat] {script_id}: exit {rc} after {time.monotonic() - t0:.1f} s")
    if not keep_dir and rc == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        log(f"[compat] kept {tmp}")
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("script", nargs="*", help="script ids (kind/name), e.g. tinker/self_cognition")
    ap.add_argument(
        "--server", default=os.environ.get("TWINKLE_SERVER_URL", "http://127.0.0.1:8000")
    )
    ap.add_argument("--key", default=os.environ.get("TWINKLE_SERVER_TOKEN", ""))
    ap.add_argument("--timeout", type=float, default=SCRIPT_TIMEOUT_S)
    ap.add_argument("--keep", action="store_true", help="keep the temp dir (script, caches)")
    ap.add_argument("--list", action="store_true", help="list script ids and substitutions")
    ap.add_argument(
        "--checkpoints",
        nargs=2,
        metavar=("ADAPTER", "SAMPLER_PATH"),
        help="for the sample scripts: use these twinkle:// paths instead of saving new ones",
    )
    ap.add_argument("--show", action="store_true", help="print the patched script, do not run it")
    args = ap.parse_args(argv)
    if args.list:
        for sid, subs in SCRIPTS.items():
            print(sid)
            for sub in subs:
                print(f"    {sub.old!r} -> {sub.new!r}\n        ({sub.why})")
        return 0
    if not args.script:
        ap.error("name a script id (or --list)")
    results = {}
    for sid in args.script:
        try:
            if args.show:
                text, origin = fetch_script(sid)
                print(f"# {origin}")
                dummy = {
                    "DATA": str(DATA),
                    "ADAPTER": "twinkle://RUN/weights/NAME",
                    "SAMPLER_PATH": "twinkle://RUN/sampler_weights/NAME",
                }
                print(apply_substitutions(sid, text, dummy, log=lambda s: print("#", s)))
                results[sid] = 0
                continue
            results[sid] = run_script(
                sid,
                args.server,
                args.key,
                timeout=args.timeout,
                keep_dir=args.keep,
                checkpoints=(
                    dict(zip(("ADAPTER", "SAMPLER_PATH"), args.checkpoints, strict=True))
                    if args.checkpoints
                    else None
                ),
            )
        except HarnessError as exc:
            print(f"[compat] {sid}: HARNESS ERROR: {exc}", file=sys.stderr)
            results[sid] = 2
    if len(results) > 1:
        for sid, rc in results.items():
            print(f"[compat] {sid}: {'PASS' if rc == 0 else f'FAIL (exit {rc})'}")
    if len(results) == 1:
        return next(iter(results.values()))
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
