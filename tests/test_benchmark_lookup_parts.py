"""benchmarks/lookup.py's `--parts`: the prefix records' keys and decoding timed within
their phase, on a real bank, and the module's functions given back after."""

from __future__ import annotations

import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # `benchmarks` is a top-level package beside cas_bank
    sys.path.insert(0, str(REPO_ROOT))

from benchmarks import lookup  # noqa: E402
from cas_bank.index import prefixes  # noqa: E402


def test_parts_time_the_prefix_keys_and_decoding_within_the_prefix_records(
    tmp_path: Path,
) -> None:
    kept = {name: getattr(prefixes, name) for name in lookup.PREFIX_PARTS}
    case = (2 * 64 * 64, 0)  # two whole segments: two records decoded
    prompts = lookup.build(tmp_path / "bank", (case,), others=0)
    parts = lookup.reopened_parts(tmp_path / "bank", prompts[case], "prefixes")
    within = {k: v for k, v in parts.items() if k.startswith("in prefix records: ")}
    assert set(within) == {f"in prefix records: {name}" for name in lookup.PREFIX_PARTS}
    assert all(0 < s < parts["prefix records"] for s in within.values())
    assert sum(within.values()) < parts["prefix records"]
    assert parts["total"] == sum(v for k, v in parts.items() if k not in within and k != "total")
    assert {name: getattr(prefixes, name) for name in lookup.PREFIX_PARTS} == kept


def test_timed_calls_sums_each_call_and_gives_the_function_back() -> None:
    spent: dict[str, float] = {}
    kept = prefixes.start_key
    with lookup.timed_calls(prefixes, ("start_key",), spent):
        assert prefixes.start_key is not kept
        assert prefixes.start_key(b"r" * 32) == kept(b"r" * 32)
        prefixes.start_key(b"s" * 32)
    assert prefixes.start_key is kept
    assert set(spent) == {"start_key"} and spent["start_key"] > 0
