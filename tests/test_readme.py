"""README.md as a new user meets it: every command and Python snippet run as written, in order.

The blocks run in a fresh temporary directory (the README's bucket, ``.ckptdelta/bucket/exp1``, and
``model_dir`` are relative paths, so they land there), with the venv's ``python``, ``ckptdelta`` and
``curl`` on PATH: shell blocks under ``bash -e -o pipefail``, Python blocks as scripts. Two substitutions:
port 8000 becomes a free port (the machine running the suite may already serve something on 8000), and
``pip install`` lines are left out (the venv set-up made holds the package with every extra).

Skipped, and why:
- a block of ``pip install`` lines alone: set-up installs the package;
- the set-up block (``make demo``, ``make test``): it runs the demo on vLLM and the whole suite, minutes;
  ``tests/benchmarks/test_demo.py`` and the suite itself are what those commands run;
- the ``--engine vllm`` block: it starts a vLLM server (a minute on CPU, or a GPU); tests/loader/engines/vllm/
  start the same replica;
- the TRL block (``GRPOTrainer``): a fragment of the user's trainer (its model, reward, dataset and replicas are
  theirs); tests/integrations/test_trainer_integrations.py runs that loop against a replica, and
  docs/INTEGRATIONS.md has it whole.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

from tests.servers import free_port

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.M | re.S)


def blocks() -> list[tuple[str, str]]:
    with open(os.path.join(REPO, "README.md")) as f:
        return [(lang, body) for lang, body in FENCE.findall(f.read()) if lang in ("sh", "python")]


def skip_reason(lang: str, body: str) -> str | None:
    if re.search(r"^make ", body, re.M):
        return "set-up: runs the demo and the whole suite"
    if "--engine vllm" in body:
        return "starts a vLLM server"
    if "GRPOTrainer(" in body:
        return "a fragment of the user's TRL trainer"
    return None


def test_every_readme_command_and_snippet_runs_as_written(tmp_path):
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": REPO}   # as from the checkout's root: benchmarks/ (the README's tiny model) is not installed
    env.pop("CKPTDELTA_STORAGE_TIMEOUT", None)
    port = str(free_port())
    ran, skipped, outputs = 0, [], []
    for i, (lang, body) in enumerate(blocks()):
        body = "\n".join(line for line in body.splitlines() if not line.startswith("pip install "))
        why = skip_reason(lang, body) if body.strip() else "install: set-up installs the package"
        if why:
            skipped.append(why)
            continue
        body = body.replace("8000", port)
        if lang == "python":
            script = tmp_path / f"readme_{i}.py"
            script.write_text(body)
            argv = [sys.executable, str(script)]
        else:
            argv = ["bash", "-e", "-o", "pipefail", "-c", body]
        t0 = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, start_new_session=True)
        try:
            out, _ = proc.communicate(timeout=240)
        finally:
            try:   # anything the block left running in the background (its own process group)
                os.killpg(proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        assert proc.returncode == 0, f"README block {i} ({lang}) failed with {proc.returncode}:\n{body}\n---\n{out}"
        outputs.append(out)
        ran += 1
        print(f"block {i} ({lang}): {time.perf_counter() - t0:.1f}s")
    assert ran == 7 and sorted(skipped) == ["a fragment of the user's TRL trainer",
                                            "install: set-up installs the package",
                                            "set-up: runs the demo and the whole suite", "starts a vLLM server"]
    text = "\n".join(outputs)
    assert "v00000002  delta" in text and "ok: v00000002" in text                  # ls, verify
    assert "verify v00000002" not in text                                          # no progress bar off a terminal
    assert "on 1 replica: 1 READY" in text and '"policy_version":2' in text       # hotload, then a completion
    assert '"chat.completion.chunk"' in text and "data: [DONE]" in text            # a stream
    assert "v00000002" in text.split("last hot-load")[-1]                         # status
    assert "model.layers.0.mlp.down_proj.weight" in text                           # read_tensors' filter
