"""The figures of one restore case (`benchmarks.restore.measure`) as the report and the
targets read them: the medians of the timed ways, the floors beside them, and the
ratios between them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from benchmarks.ceilings import dir_bytes, median, speed_fraction

if TYPE_CHECKING:
    from benchmarks.restore import RestoreCase

# The ways `benchmarks.restore._ways` times, in the order the figures list them.
_WAYS = ("file", "reopened", "hot", "on_path", "handout")


def case_figures(
    case: RestoreCase,
    m: dict[str, float],
    hot_hits: float,
    floors: dict[str, Any],
    forward: float,
    stages: dict[str, float],
) -> dict[str, Any]:
    """The case's figures as the report and the targets read them."""
    rocks, hot, load, handout = m["reopened"], m["hot"], m["file"], m["handout"]
    later = case.later
    caller = median([c for c, _ in later])
    return {
        "model": case.name,
        "tokens": case.length,
        "restored": case.length,
        "kv_bytes": case.nbytes,
        "hot_hits_per_request": hot_hits,
        "store_s": case.store_s,
        "store_later_caller_s": caller,
        "store_later_flush_s": median([f for _, f in later]),
        "file_load_s": load,
        "rocksdb_restore_s": rocks,
        "hot_restore_s": hot,  # a lease restored again: copied ahead (restore.lease_copy)
        "hot_on_path_s": m["on_path"],  # the same with the copy on the restore's path
        "hot_handout_s": handout,
        "ttft_s": {way: m[f"{way}_ttft"] for way in _WAYS},
        # The restore (or load) and the first cache update alone (no model): what the
        # first prefill chunk copies, without the forward pass that hides it in TTFT.
        "first_update_s": {way: m[f"{way}_update"] for way in _WAYS},
        # The floors (`restore_floors.case_floors`) and a hot restore's copy alone: the
        # prefix's arrays into resident arrays with room, not in cache
        # (`layout_copy_samples`): the floor of a restore that copies.
        **floors,
        # Where a reopened restore's time goes (`Hit.timings`, medians): beside the
        # floor, which pays neither the index, nor the allocation, nor Python.
        "reopened_stages_s": stages,
        "forward_s": forward,
        "bytes_on_disk": {
            "mlx_lm_file": case.file.stat().st_size,
            "cas_bank": dir_bytes(case.path),
        },
        "fractions": _fractions(m, floors, forward, caller),
        "gbps": {
            "file_load": case.nbytes / load / 1e9,
            "rocksdb_restore": case.nbytes / rocks / 1e9,
            "hot_restore": case.nbytes / hot / 1e9,
        },
    }


def _fractions(
    m: dict[str, float], floors: dict[str, Any], forward: float, caller: float
) -> dict[str, float]:
    """The case's ratios: each way against its floor, and the file against each way."""
    rocks, hot, load, handout = m["reopened"], m["hot"], m["file"], m["handout"]
    ceiling, mem, mem2 = (
        floors["verified_floor_s"],
        floors["memcpy_s"],
        floors["memcpy_2_threads_s"],
    )
    return {
        "rocksdb_restore_of_ceiling": speed_fraction(rocks, ceiling),
        # The best a verified restore can do against the file: the file / the floor.
        "file_load_over_floor": load / ceiling,
        "file_load_over_blake3_floor": load / floors["blake3_floor_s"],
        # TTFT ratios: the median of each round's (`_timed`), not of the medians.
        "file_ttft_over_forward": m["file_over_forward"],
        # A hot restore with room copies the prefix once (the bank keeps its own):
        # the most it can reach is the file's TTFT over that forward and one copy.
        # The prefix's copy at its best: the restore's own (streamed) or a memcpy.
        "file_ttft_over_forward_and_copy": m["file_over_forward"]
        * forward
        / (forward + min(mem2, floors.get("hot_copy_floor_s", mem2))),
        "hot_restore_of_memcpy": speed_fraction(hot, mem),
        # What a background store costs the caller's thread, in memcpys of its bytes.
        "store_later_caller_over_memcpy": caller / mem,
        "file_load_over_rocksdb_restore": load / rocks,
        "file_load_over_hot_restore": load / hot,
        "file_load_over_hot_on_path": load / m["on_path"],
        "file_ttft_over_on_path_ttft": m["file_over_on_path_ttft"],
        "file_load_over_hot_handout": load / handout,
        "file_ttft_over_reopened_ttft": m["file_over_reopened_ttft"],
        "file_ttft_over_hot_ttft": m["file_over_hot_ttft"],
        "file_ttft_over_handout_ttft": m["file_over_handout_ttft"],
    }
