"""Agents sending the same image with different questions to mlx-vlm's server: time to
first token and hit rate, with no cache, with mlx-vlm's own prefix cache (APC, in memory
and with its SSD tier) and on the bank (`cas-bank mlx-vlm-server`), before and after a
restart; and the bytes each keeps against one cache per agent.

    python -m benchmarks.vlm_agents            # the default sizes (~1-2 min on 2 cores)
    python -m benchmarks.vlm_agents --quick    # the smoke test's

Each way (`vlm_servers.WAYS`) runs the same script on its own fresh directory: a server
starts; `agents` agents each send one request (the system prompt, the image, the task
text, then a question of their own); the server stops (SIGTERM) and starts again on the
same directory; `agents` more agents send the same image with new questions. The first
request of each round meets whatever that way kept; the others, what the first left.
Every way's server is up at once and the agents ask them in turn (the order rotated
from one agent to the next), so the load of a shared machine falls on all alike.
The model is a larger sibling of the embedded tiny Qwen2-VL (`BENCH_TEXT`,
`BENCH_VISION`: seeded weights, a local tokenizer and processor; `vlm_model_dir`),
images of `image_px`² pixels (`image_px`²/784 image tokens). Greedy answers; each way's
answers are compared with those of `none` (text and the chosen tokens' logprobs).

Hit rate: the request's cached tokens over its prompt tokens, as the server reports
them (`usage.prompt_tokens_details.cached_tokens`). Bytes: what the way keeps on disk
after the first round (the bank's payload, state and end-record bytes; APC's SSD files)
against `agents` private copies of the first agent's prompt KV (what a per-agent cache
would hold: prompt tokens x layers x 2 x kv heads x head dim x 4 bytes).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Final

from cas_bank.runtime.mlx_vlm_dirs import vlm_model_dir
from cas_bank.runtime.vlm_models import random_image, vlm_config

from benchmarks.vlm_servers import WAYS, Answer, VlmServer, ask, data_url, messages, start

BENCH_TEXT: Final = dict(
    hidden_size=128,
    num_hidden_layers=6,
    intermediate_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_scaling={"type": "mrope", "mrope_section": [4, 6, 6]},  # head_dim 32
)
BENCH_VISION: Final = dict(depth=2, embed_dim=64, num_heads=2, hidden_size=128)
# What every agent's message says after the image, before its own question: an agent's
# task text (without it mlx-vlm's APC reuses nothing of an image whose next block holds
# the first words of a question; see RESULTS.md).
TASK: Final = (
    "Read the screenshot: find the window title, the buttons and the text fields, then "
    "answer the question below in one line. "
)
SYSTEM: Final = (
    "You are an agent of a team that works through the same screenshots. Tools: "
    "click(x, y), type(text), scroll(dy), read(region). Answer with one tool call. "
)


@dataclass(frozen=True)
class VlmSettings:
    agents: int = 4  # per round; two rounds (before and after the restart)
    system_repeats: int = 3  # the system prompt's length (~100 tokens a repeat)
    image_px: int = 336  # 336x336: 144 image tokens
    max_tokens: int = 2
    bench_model: bool = True  # False: the embedded tiny model (the smoke test)
    ways: tuple[str, ...] = WAYS


def tiny_settings() -> VlmSettings:
    """The smoke test's: the embedded tiny model, no cache against the bank."""
    return VlmSettings(
        agents=2, system_repeats=2, image_px=112, bench_model=False, ways=("none", "bank")
    )


def bench_config() -> dict[str, Any]:
    """The benchmark's model: the tiny Qwen2-VL's family at `BENCH_TEXT`/`BENCH_VISION`."""
    config = vlm_config("tiny-qwen2-vl")
    config.update(BENCH_TEXT)
    config["vision_config"].update(BENCH_VISION)
    return config


def _kv_bytes_per_token(config: dict[str, Any]) -> int:
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    return int(config["num_hidden_layers"] * 2 * config["num_key_value_heads"] * head_dim * 4)


def _kept_bytes(server: VlmServer) -> int | None:
    """What the way keeps on disk now (None: nothing kept)."""
    if server.way == "bank":
        b = server.stats()["bank"]
        return int(b["payload_bytes"] + b["state_bytes"] + b["end_bytes"])
    if server.way == "apc-disk":
        return int(server.stats().get("disk_bytes") or 0)
    return None


def _started(ways: tuple[str, ...], model: Path, workdir: Path) -> dict[str, Any]:
    """A server of each way, with how long it took to answer /health."""
    servers: dict[str, Any] = {}
    try:
        for way in ways:
            t0 = time.perf_counter()
            servers[way] = (start(way, model, workdir / way), time.perf_counter() - t0)
    except BaseException:
        for server, _ in servers.values():
            server.stop()
        raise
    return servers


def _rounds(model: Path, workdir: Path, image: str, s: VlmSettings) -> dict[str, Any]:
    """Both rounds, every way's server up together and the agents' requests interleaved
    (agent i asks each way in turn, the order rotated by i), so that the load of a
    shared machine falls on every way alike."""
    system = SYSTEM * s.system_repeats
    out: dict[str, Any] = {w: {"rounds": [], "kept_bytes": None} for w in s.ways}
    for r in range(2):
        servers = _started(s.ways, model, workdir)
        answers: dict[str, list[Answer]] = {w: [] for w in s.ways}
        try:
            for i in range(s.agents):
                chat = messages(
                    system,
                    image,
                    TASK + f"Agent {r * s.agents + i}: what is in the top left corner?",
                )
                for w in s.ways[i % len(s.ways) :] + s.ways[: i % len(s.ways)]:
                    answers[w].append(
                        ask(servers[w][0], chat, max_tokens=s.max_tokens, logprobs=True)
                    )
            if r == 0:
                for w in s.ways:
                    out[w]["kept_bytes"] = _kept_bytes(servers[w][0])
        finally:
            for server, _ in servers.values():
                server.stop()
        for w in s.ways:
            out[w]["rounds"].append(
                {"start_s": servers[w][1], "answers": [asdict(a) for a in answers[w]]}
            )
    return out


def _summary(way: dict[str, Any]) -> dict[str, Any]:
    """First request and the others, per round: TTFT and hit rate."""
    out: dict[str, Any] = {}
    for name, rnd in zip(("before", "after_restart"), way["rounds"], strict=True):
        a = rnd["answers"]
        rest = a[1:] or a
        out[name] = {
            "first_ttft_s": a[0]["ttft_s"],
            "first_hit": a[0]["cached_tokens"] / a[0]["prompt_tokens"],
            "rest_ttft_p50_s": statistics.median(x["ttft_s"] for x in rest),
            "rest_hit": sum(x["cached_tokens"] for x in rest)
            / sum(x["prompt_tokens"] for x in rest),
            "start_s": rnd["start_s"],
        }
    return out


def run(workdir: Path, s: VlmSettings) -> dict[str, Any]:
    """Every way of `s.ways` on one model and one image (see the module docstring)."""
    config = bench_config() if s.bench_model else vlm_config("tiny-qwen2-vl")
    px = s.image_px * s.image_px
    model = vlm_model_dir(workdir / "model", config=config, max_pixels=max(px, 112 * 112))
    image = data_url(random_image(7, (s.image_px, s.image_px)))
    ways = _rounds(model, workdir, image, s)
    reference = ways.get("none")
    for w in ways.values():
        w["summary"] = _summary(w)
        if reference is not None:
            pairs = zip(w["rounds"], reference["rounds"], strict=True)
            w["same_answers_as_none"] = all(
                (a["text"], a["logprobs"]) == (b["text"], b["logprobs"])
                for mine, ref in pairs
                for a, b in zip(mine["answers"], ref["answers"], strict=True)
            )
    first = next(iter(ways.values()))["rounds"][0]["answers"][0]
    per_agent = first["prompt_tokens"] * _kv_bytes_per_token(config)
    return {
        "settings": asdict(s),
        "model": {
            "text": {k: config[k] for k in BENCH_TEXT if k in config},
            "layers": config["num_hidden_layers"],
        },
        "prompt_tokens": first["prompt_tokens"],
        "kv_bytes_per_token": _kv_bytes_per_token(config),
        "one_copy_per_agent_bytes": 2 * s.agents * per_agent,
        "ways": ways,
    }


def markdown(r: dict[str, Any]) -> list[str]:
    """RESULTS.md's section (empty when the part did not run)."""
    v = r.get("vlm_agents")
    if not v:
        return []
    from benchmarks.targets import mb, table

    s = v["settings"]
    n = 2 * s["agents"]
    L = [
        "## Images in the prefix: agents sharing one screenshot (mlx-vlm's server)",
        "",
        f"{s['agents']} agents send one image ({s['image_px']}x{s['image_px']} px) with a "
        f"{v['prompt_tokens']}-token prompt and a question each; the server restarts; "
        f"{s['agents']} more agents ask about the same image (`benchmarks/vlm_agents.py`). "
        "TTFT of each round's first request and the median of the others; hit rate = cached "
        "prompt tokens / prompt tokens. `none`: mlx-vlm without a cache; `apc`: its prefix "
        "cache in memory; `apc-disk`: with its SSD tier (mlx-vlm 0.7.10 keeps it across "
        "restarts); `bank`: `cas-bank mlx-vlm-server`.",
        "",
    ]
    L += table(
        [
            "way",
            "1st TTFT ms",
            "others TTFT p50 ms",
            "others hit",
            "after restart: 1st TTFT ms",
            "1st hit",
            "others TTFT p50 ms",
            "others hit",
            "MB kept",
            "answers = none's",
        ],
        [_way_row(name, w) for name, w in v["ways"].items()],
    )
    L += [
        f"One private cache per agent ({n} agents) would hold "
        f"{mb(v['one_copy_per_agent_bytes'])} MB of KV ({v['kv_bytes_per_token']} bytes a token); "
        "the bank's bytes include each image's encoder output.",
        "",
        _READING,
        "",
    ]
    return L


def _way_row(name: str, w: dict[str, Any]) -> list[str]:
    """One way's figures: before and after the restart, bytes kept, answers."""
    from benchmarks.targets import mb, ms

    b, a = w["summary"]["before"], w["summary"]["after_restart"]
    return [
        name,
        ms(b["first_ttft_s"]),
        ms(b["rest_ttft_p50_s"]),
        f"{b['rest_hit']:.0%}",
        ms(a["first_ttft_s"]),
        f"{a['first_hit']:.0%}",
        ms(a["rest_ttft_p50_s"]),
        f"{a['rest_hit']:.0%}",
        mb(w["kept_bytes"]),
        {True: "yes", False: "no"}.get(w.get("same_answers_as_none"), "–"),
    ]


_READING = (
    "Reading (mlx-vlm 0.7.10, read in its source and seen in these counts): its prefix "
    "cache in memory refuses every prefix that holds image tokens (`apc_lookup_plan`, "
    "`prefix_has_media`), so within a run it reuses nothing of these prompts; its SSD "
    "tier, read only when the memory pool misses, reuses whole 16-token blocks that "
    "reach past the image (here the task text after the image makes them), so after a "
    "restart. The bank restores to the token within a run and after a restart, and "
    "hands mlx-vlm each image's encoder output, which its Qwen2-VL otherwise computes "
    "on every request, a prefix hit or not."
)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vlm_agents", description=__doc__)
    ap.add_argument("--quick", action="store_true", help="the smoke test's sizes")
    ap.add_argument("--agents", type=int, default=VlmSettings.agents)
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--out", type=Path, default=None, help="write the results JSON here")
    args = ap.parse_args(argv)
    s = tiny_settings() if args.quick else VlmSettings(agents=args.agents)
    s = replace(s, ways=tuple(w for w in args.ways.split(",") if w))
    with tempfile.TemporaryDirectory(prefix="cas_bank_vlm_") as tmp:
        r = run(Path(tmp), s)
    print("\n".join(markdown({"vlm_agents": r})))
    if args.out is not None:
        args.out.write_text(json.dumps(r, indent=2) + "\n")
    return r


if __name__ == "__main__":
    main()
