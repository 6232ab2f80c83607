"""``ckptdelta inspect URL SNAPSHOT``: a snapshot of a run the real Publisher wrote, read from its bucket."""

from __future__ import annotations

import json

import torch

from ckptdelta.cli import main
from tests.replicas import corrupt_delta, lm_dir, publish_run  # noqa: F401


def test_inspect_a_snapshot_of_a_run_lists_its_records_and_checks_them(lm_dir, tmp_path, capsys):  # noqa: F811
    run = publish_run(str(tmp_path / "bucket" / "run"), lm_dir, n_versions=3)
    try:
        assert main(["inspect", run.url, "1", "--json"]) == 0
        got = json.loads(capsys.readouterr().out)
        assert got["snapshot"] == "v00000001" and got["kind"] == "delta" and got["parent_version"] == 0
        changed = {t["name"] for t in got["tensors"]}
        assert changed and len(changed) + got["unchanged_tensors"] == len(run.truth[1])
        assert changed == {n for n, t in run.truth[1].items()
                           if not torch.equal(t.view(torch.int16), run.truth[0][n].view(torch.int16))}
        assert all(t["has_parent"] and sum(t["chunks"].values()) >= 1 for t in got["tensors"])
        assert sum(t["encoded_bytes"] for t in got["tensors"]) <= sum(o["size"] for o in got["objects"])

        assert main(["inspect", run.url, "0"]) == 0           # an anchor: from its manifest
        out = capsys.readouterr().out
        assert out.startswith(f"snapshot v00000000 (version 0) of run {got['run_id']}: anchor")
        assert "model.embed_tokens.weight" in out

        assert main(["inspect", run.url, "latest"]) == 0
        assert "v00000002" in capsys.readouterr().out
        corrupt_delta(run, 2)
        assert main(["inspect", run.url, "2"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith("ckptdelta inspect: error:") and "\n" not in err and "deltas/" in err
        assert main(["inspect", run.url, "7"]) == 1
        assert "no committed snapshot v00000007" in capsys.readouterr().err
    finally:
        run.close()
