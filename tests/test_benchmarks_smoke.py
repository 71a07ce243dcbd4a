"""The benchmarks still run: every module's `main` at its tiniest sizes, and the report.

Not a speed test (speed is what `make bench` reports); this keeps `benchmarks/` from
rotting as the library changes under it, and checks what the benchmarks check of
themselves: every way of reaching the first token gives the cold prefill's logits
and restores what it should.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from conftest import REPO_ROOT

if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level package beside cas_bank
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import ceilings, first_token, fleet, restore, run, scale, ttft


def test_every_benchmark_main_runs_at_tiny_sizes_and_writes_the_report(tmp_path: Path) -> None:
    c = ceilings.main(["--quick"])
    assert c["memcpy_gbps"] > 0 and c["blake3_gbps"] > 0 and len(c["rocks"]) == 2

    t = ttft.main(["--tiny"])
    assert t["problems"] == []
    for case in t["cases"]:
        for way in ("mlx_lm_file", "cas_bank_rocksdb", "cas_bank_hot"):
            assert case["restored"][way] == case["tokens"] - 1
            assert case["logits_max_diff"][way] <= 1e-3
        assert case["hot_hits_per_request"] >= 1  # the hot way really was served hot

    rs = restore.main(["--tiny"])
    for case in rs["cases"]:
        assert case["restored"] == case["tokens"] and case["hot_hits_per_request"] >= 1

    ft = first_token.main(["--tiny"])  # every way's logits are the limit's, all restored
    assert ft["problems"] == []
    for case in ft["cases"]:
        prefix, talk = case["tokens"], case["tokens"] + case["answer_tokens"]
        assert case["shared_prefix"]["mlx_lm_lru"]["restored"] == prefix
        assert case["next_turn"]["mlx_lm_lru"]["restored"] == talk
        assert prefix <= case["next_turn"]["bank"]["restored"] <= talk
        assert case["after_restart"]["bank_reopened"]["restored"] == prefix
        # cas-bank serve: the stored prefix, and the next turn through its own answer
        # (all that went through the model: turn 1's prompt, prefix + 1, and the answer
        # but its last token); a fresh server on the same bank restores the prefix.
        assert case["shared_prefix"]["serve"]["restored"] == prefix
        assert case["next_turn"]["serve"]["restored"] == talk
        assert case["next_turn"]["serve"]["prefilled"] == case["new_tokens"] + 1
        assert case["after_restart"]["serve_restarted"]["restored"] == prefix
    for layout in ft["prefill_or_restore"]:
        assert layout["points"][0]["prefill_s"] > 0 and len(layout["apple_estimate"]) >= 3

    f = fleet.main(["--tiny"])
    s = f["settings"]
    assert f["requests"] == s["agents"] * s["turns"]
    # From the third request of turn 1 on, the shared system prompt is restored.
    assert all(r["restored"] >= s["system_tokens"] for r in f["per_request"][2:])
    assert f["bytes"]["lower_bound"] > 0 and f["bytes"]["session_files_latest"] > 0

    sc = scale.main(["--tiny"])
    assert sc["big_blocks"] == scale.tiny_settings().blocks
    assert sc["lookup"]["matched_tokens"] == sc["lookup"]["tokens"]

    out = tmp_path / "report"
    res = run.main(["--quick", "--out", str(out), "--workdir", str(tmp_path)])
    rt = res["remote"]  # the shared tier on a real cluster: sharing restores across hosts
    shared, alone = rt["fleet"]["hosts_sharing_cluster"], rt["fleet"]["hosts_alone"]
    assert shared["hit_rate"] > alone["hit_rate"] and shared["rejected"] == 0
    assert rt["cluster_bytes"]["ratio_to_lower_bound"] >= 1.0
    ld = res["remote_load"]  # sustained load: every restore checked bit for bit
    assert ld["restores"] > 0 and ld["wrong"] == 0 and ld["rejected"] == 0
    vlm = res["vlm_agents"]["ways"]  # one image, several agents: the bank restores it
    assert vlm["bank"]["summary"]["before"]["rest_hit"] > 0.5
    assert vlm["bank"]["summary"]["after_restart"]["first_hit"] > 0.5
    assert vlm["bank"]["same_answers_as_none"] and vlm["none"]["summary"]["before"]["rest_hit"] == 0
    pf = res["remote_prefetch"]  # a queued request's prefix is local by its turn
    assert pf["prefetch_on"]["remote_hit_blocks"] < pf["prefetch_off"]["remote_hit_blocks"]
    for row in res["remote_rtt"]["by_rtt"]:  # at each latency: headers, then payloads
        assert all(row[str(n)]["round_trips"] >= 2 for n in run.remote_rtt.tiny_settings().tokens)
    saved = json.loads((out / "results.json").read_text())
    assert saved["mode"] == "quick" and saved["targets"] == res["targets"]
    md = (out / "RESULTS.md").read_text()
    assert "## Machine" in md and "## Targets" in md and saved["machine"]["cpu"] in md
    assert "## Shared tier under sustained load" in md and "network's latency" in md
    assert "## Prefetch in the server's queue" in md
    assert "## Stores off the request path, in the server" in md  # a part of PARTS
    st = res["server_store"]["modes"]  # what each mode wrote: the store is really off
    assert st["off"]["bytes_written"] == 0 < st["inline"]["bytes_written"]
    assert st["background"]["bytes_written"] == st["inline"]["bytes_written"]
    assert "## The first token against mlx-lm's in-memory cache" in md
    assert "The same situations in `cas-bank serve`" in md
    assert any(t["where"].endswith("cas-bank serve") for t in res["targets"])
    assert "## Where prefilling beats restoring" in md and "Apple silicon est." in md
    assert "## Partial blocks: agents branching at arbitrary points" in md
    assert "## Eviction order on a mixed workload" in md  # each order on the same requests
    ev = res["eviction_policy"]["results"]
    assert {r["policy"] for r in ev} == {"lru", "lfu"} and all(r["requests"] > 0 for r in ev)
    runs = res["branching"]["runs"]  # the same requests: partial blocks never prefill more
    for bs in run.fleet.tiny_branch_settings().block_sizes:
        assert runs[f"{bs}/partial"]["prefilled_tokens"] <= runs[f"{bs}/whole"]["prefilled_tokens"]
    rows = [line for line in md.splitlines() if line.endswith("| met |") or "**missed**" in line]
    assert len(rows) == len(res["targets"]) >= 13
    assert (out / "ttft.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
