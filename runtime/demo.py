"""The main job: a fleet of agents on one server, a restart, and what the bank saved.

`run_demo` starts the real server (`server.BackgroundServer`, FastAPI on a loopback
port of this process) on the embedded tiny hybrid model and plays `agents` agents
that share one long system prompt (~2k tokens: instructions and tool definitions)
with distinct conversations, `turns` turns each, interleaved as a fleet would send
them. Then it stops the server (the bank is closed), builds the model again from the
same seed, starts a new server on the same bank directory and plays one more turn.
Every request goes over HTTP with `stream: true`; time to first token is measured by
the client (request sent -> first streamed chunk, which the server sends as soon as
the first token is sampled).

What it reports, per agent and turn: prompt tokens, tokens restored from the bank
(`usage.prompt_tokens_details.cached_tokens`), time to first token. At the end:
- the bytes the bank holds (KV blocks + GDN states, as stored) and its directory on
  disk, against what per-session snapshots would hold: for each agent, its whole
  conversation's cache written with mlx-lm's `save_prompt_cache` (computed for real:
  a plain mlx-lm prefill of the conversation, KV buffers trimmed to the tokens held,
  which is kinder to the baseline than the 256-token padded buffers mlx-lm writes);
- the hit rate: restored prompt tokens / prompt tokens, over every request.

The model has random weights, so left alone it emits reserved ids and stray bytes
that no chat template can reproduce. The agents therefore send an OpenAI
`logit_bias` that favours printable ASCII (and the end-of-message token), the way a
trained model writes text; that is what lets a follow-up turn match the previous
answer's tokens and restore through it.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx_lm.models.cache import KVCache, QuantizedKVCache, make_prompt_cache, save_prompt_cache
from rich import box
from rich.table import Table

from .engine import Engine
from .models import DEFAULT_MODEL, resolve_model
from .server import BackgroundServer
from .tokenizer import END_OF_MESSAGE_ID, AnyTokenizer, ByteTokenizer, chat_tokens

_TOOLS = [
    ("search_docs", "query: string, limit: integer = 5", "Full-text search over the team wiki."),
    ("read_file", "path: string, start: integer = 0, end: integer = -1", "Read lines of a file."),
    ("write_file", "path: string, content: string", "Create or replace a file in the workspace."),
    ("run_tests", "selector: string = ''", "Run the test suite, or the tests matching selector."),
    ("open_ticket", "title: string, body: string, labels: list[string]", "File a ticket."),
    ("query_metrics", "name: string, window: string = '1h'", "Read a time series from monitoring."),
    ("send_message", "channel: string, text: string", "Post a message to a chat channel."),
    ("schedule", "when: string, what: string", "Put a reminder on the team calendar."),
    ("summarize", "text: string, words: integer = 80", "Summarize a long text in plain words."),
    ("translate", "text: string, target: string", "Translate text into the target language."),
]


def system_prompt() -> str:
    """The shared system prompt: instructions and tool definitions (~2k bytes = tokens)."""
    lines = [
        "You are one agent of an operations team. Work carefully, one step at a time.",
        "Rules: answer in plain text; never invent facts; cite the tool output you used;",
        "ask for confirmation before any action that writes or sends; keep answers short.",
        "When a tool fails, report the error message verbatim and suggest one next step.",
        "",
        "Tools (call one as NAME(arguments) on a line of its own):",
    ]
    for name, args, what in _TOOLS:
        lines.append(f"- {name}({args}): {what}")
        lines.append(f"  returns: JSON with fields 'ok' (bool) and 'result' or 'error' for {name}.")
    lines += ["", "Begin each answer with a one-line plan, then act."]
    return "\n".join(lines)


_TASKS = [
    "check why the nightly build failed",
    "summarize yesterday's incident report",
    "find the owner of the billing service",
    "draft release notes for version 2.4",
    "compare error rates before and after the deploy",
    "plan the database migration for next week",
    "collect open tickets about slow logins",
    "translate the onboarding guide into Spanish",
]


def user_message(agent: int, turn: int) -> str:
    task = _TASKS[agent % len(_TASKS)]
    if turn == 0:
        return f"I am agent {agent}. Task: {task}. What is your plan?"
    return f"Agent {agent}, step {turn + 1}: go on with the task ({task}); what next?"


def demo_logit_bias() -> dict[str, float]:
    """+100 for printable ASCII and the end-of-message token (see the module docstring)."""
    allowed = [*range(32, 127), END_OF_MESSAGE_ID]
    return {str(i): 100.0 for i in allowed}


@dataclass(frozen=True, slots=True)
class TurnRow:
    phase: str  # "before restart" / "after restart"
    agent: int
    turn: int
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_s: float


@dataclass
class DemoReport:
    model: str
    agents: int
    turns: int
    block_size: int
    bank_dir: str | None  # None: a temporary bank, removed at the end
    system_prompt_tokens: int
    rows: list[TurnRow] = field(default_factory=list)
    bank_stored_bytes: int = 0  # KV payloads + states, as the bank counts them
    bank_disk_bytes: int = 0  # the bank directory on disk after close
    snapshot_bytes: int = 0  # per-session save_prompt_cache files, all agents
    snapshot_tokens: int = 0  # tokens those snapshots cover
    restart_s: float = 0.0  # server stop + model rebuild + bank reopen + start

    @property
    def hit_rate(self) -> float:
        prompt = sum(r.prompt_tokens for r in self.rows)
        return sum(r.cached_tokens for r in self.rows) / prompt if prompt else 0.0

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["hit_rate"] = self.hit_rate
        return out


Progress = Callable[[str], None]


def run_demo(
    agents: int,
    turns: int,
    *,
    max_tokens: int,
    block_size: int,
    bank_dir: str | Path | None = None,
    seed: int = 0,
    progress: Progress | None = None,
    model: str | Path | None = None,
) -> DemoReport:
    """Play the demo (see the module docstring); `progress` is called after each step.

    `model`: an embedded model name or a local mlx-lm model directory (its own
    tokenizer and chat template are used); None for the embedded tiny hybrid.

    Steps: `agents * (turns + 1)` requests, then `agents` snapshot measurements.
    `bank_dir=None` uses a temporary directory, removed at the end.
    """
    if agents < 1 or turns < 1:
        raise ValueError(f"the demo needs at least 1 agent and 1 turn, got {agents} and {turns}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    step = progress or (lambda _msg: None)
    with _bank_location(bank_dir) as path:
        loaded = resolve_model(model, seed=seed)
        report = DemoReport(
            model=loaded.name,
            agents=agents,
            turns=turns,
            block_size=block_size,
            bank_dir=str(path) if bank_dir is not None else None,
            system_prompt_tokens=len(loaded.tokenizer.encode(system_prompt())),
        )
        fleet = _Fleet(report, loaded.tokenizer, max_tokens, step, agents)
        _play_across_a_restart(fleet, path, turns, block_size, seed, model)
        report.bank_disk_bytes = _dir_bytes(path)
        _measure_snapshots(fleet, loaded.model)
        return report


class _Fleet:
    """The demo's agents: one conversation each (the shared system prompt first), and
    the report their requests' rows go to."""

    def __init__(
        self,
        report: DemoReport,
        tokenizer: AnyTokenizer,
        max_tokens: int,
        step: Progress,
        agents: int,
    ) -> None:
        self.report = report
        self.tokenizer = tokenizer
        self.max_tokens = max_tokens
        self.step = step
        self.conversations = [
            [{"role": "system", "content": system_prompt()}] for _ in range(agents)
        ]

    def play(self, server: BackgroundServer, phase: str, turn: int) -> None:
        """One turn of every agent, in order: a user message, the server's reply."""
        for agent, messages in enumerate(self.conversations):
            messages.append({"role": "user", "content": user_message(agent, turn)})
            reply, row = _chat(
                server.url,
                messages,
                self.max_tokens,
                phase,
                agent,
                turn,
                self.tokenizer,
                server.engine.model_id,
            )
            messages.append({"role": "assistant", "content": reply})
            self.report.rows.append(row)
            self.step(f"{phase}: agent {agent} turn {turn + 1}")


def _play_across_a_restart(
    fleet: _Fleet, path: Path, turns: int, block_size: int, seed: int, model: str | Path | None
) -> None:
    """`turns` turns on a server, a restart (timed), one more turn; then what the bank
    stores, once the last request's store is written."""
    report = fleet.report
    server = _start(path, block_size, seed, model)
    for turn in range(turns):
        fleet.play(server, "before restart", turn)
    t0 = time.perf_counter()
    server.stop()  # closes the engine and the bank
    server = _start(path, block_size, seed, model)
    report.restart_s = time.perf_counter() - t0
    try:
        fleet.play(server, "after restart", turns)
        server.engine.bank.flush()  # the last request's store may still be queued
        stats = server.engine.bank.stats()
        report.bank_stored_bytes = stats.payload_bytes + stats.state_bytes
    finally:
        server.stop()


def _measure_snapshots(fleet: _Fleet, model: Any) -> None:
    """Each agent's whole conversation as a `save_prompt_cache` file: its bytes and tokens."""
    with tempfile.TemporaryDirectory(prefix="cas_bank_snapshots_") as snap_dir:
        for agent, messages in enumerate(fleet.conversations):
            ids = _conversation_ids(fleet.tokenizer, messages)
            file = Path(snap_dir) / f"agent{agent}.safetensors"
            fleet.report.snapshot_bytes += session_snapshot_bytes(model, ids, file)
            fleet.report.snapshot_tokens += len(ids)
            fleet.step(f"snapshot of agent {agent}")


def session_snapshot_bytes(model: Any, tokens: list[int], file: Path) -> int:
    """Size of the `save_prompt_cache` file of `tokens`' cache (plain mlx-lm, no bank)."""
    cache = make_prompt_cache(model)
    for start in range(0, len(tokens), 512):
        model(mx.array(tokens[start : start + 512])[None], cache=cache)
        mx.eval([c.state for c in cache])
    for c in cache:
        if not isinstance(c, (KVCache, QuantizedKVCache)):
            continue
        kv: Any = c  # mlx-lm's attributes are untyped (None until the first update)
        n = kv.offset
        if isinstance(c, QuantizedKVCache):
            kv.keys = tuple(a[..., :n, :] for a in kv.keys)
            kv.values = tuple(a[..., :n, :] for a in kv.values)
        else:
            kv.keys, kv.values = kv.keys[..., :n, :], kv.values[..., :n, :]
    save_prompt_cache(str(file), cache)
    return file.stat().st_size


def _conversation_ids(tokenizer: AnyTokenizer, messages: list[dict[str, str]]) -> list[int]:
    """The whole conversation's ids, through the model's own chat template."""
    if isinstance(tokenizer, ByteTokenizer):
        return tokenizer.apply_chat_template(messages, add_generation_prompt=False)
    return chat_tokens(tokenizer, messages)  # ends with a generation prompt: a few more ids


def _start(
    path: Path, block_size: int, seed: int, model: str | Path | None = None
) -> BackgroundServer:
    engine = Engine.open(path, model or DEFAULT_MODEL, block_size=block_size, seed=seed)
    try:
        return BackgroundServer(engine).start()
    except BaseException:
        engine.close()
        raise


def _chat(
    url: str,
    messages: list[dict[str, str]],
    max_tokens: int,
    phase: str,
    agent: int,
    turn: int,
    tokenizer: AnyTokenizer,
    model_id: str,
) -> tuple[str, TurnRow]:
    """One streamed chat completion; the reply and its row (TTFT measured here)."""
    body: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # The byte tokenizer's printable ids; a trained tokenizer's ids mean other things.
    if isinstance(tokenizer, ByteTokenizer):
        body["logit_bias"] = demo_logit_bias()
    body["model"] = model_id
    request = urllib.request.Request(
        f"{url}/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    sent = time.perf_counter()
    ttft: float | None = None
    parts: list[str] = []
    usage: dict[str, Any] | None = None
    with urllib.request.urlopen(request, timeout=300) as response:
        for chunk in _sse_events(response):
            if "error" in chunk:
                raise RuntimeError(f"the server failed a demo request: {chunk['error']['message']}")
            if chunk["choices"] and ttft is None:
                ttft = time.perf_counter() - sent
            for choice in chunk["choices"]:
                parts.append(choice["delta"].get("content") or "")
            usage = chunk.get("usage") or usage
    if usage is None or ttft is None:
        raise RuntimeError("the server's stream ended without a token or without usage")
    row = TurnRow(
        phase=phase,
        agent=agent,
        turn=turn + 1,
        prompt_tokens=usage["prompt_tokens"],
        cached_tokens=usage["prompt_tokens_details"]["cached_tokens"],
        completion_tokens=usage["completion_tokens"],
        ttft_s=ttft,
    )
    return "".join(parts), row


def _sse_events(response: Any) -> Iterator[dict[str, Any]]:
    for raw in response:
        line = raw.decode("utf-8").strip()
        if not line.startswith("data: "):
            continue
        data = line[len("data: ") :]
        if data == "[DONE]":
            return
        yield json.loads(data)


@contextmanager
def _bank_location(bank_dir: str | Path | None) -> Iterator[Path]:
    if bank_dir is not None:
        path = Path(bank_dir)
        path.parent.mkdir(parents=True, exist_ok=True)
        yield path
        return
    tmp = Path(tempfile.mkdtemp(prefix="cas_bank_demo_"))
    try:
        yield tmp / "bank"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


# -- printing ---------------------------------------------------------------------------
def report_tables(report: DemoReport) -> list[Table]:
    """The per-request table and the summary, for a rich console (fit 80 columns)."""
    turns = Table(
        title=f"{report.agents} agents x {report.turns} turns on {report.model}, a restart, "
        f"one more turn\n(block size {report.block_size}, shared system prompt "
        f"{report.system_prompt_tokens} tokens)",
        title_justify="left",
        caption="cached: prompt tokens restored from the bank (whole blocks, up to a "
        "boundary with a stored GDN state). The first agent's prefill stores the state at "
        "the end of the system prompt's full blocks (the chat's branch point), so every "
        "later agent restores the shared prompt.",
        caption_justify="left",
        box=box.SIMPLE_HEAD,
    )
    columns = ("run", "agent", "turn", "prompt", "cached", "prefilled", "TTFT ms")
    for name in columns:
        turns.add_column(name, justify="left" if name == "run" else "right", no_wrap=True)
    for r in report.rows:
        turns.add_row(
            r.phase,
            str(r.agent),
            str(r.turn),
            str(r.prompt_tokens),
            str(r.cached_tokens),
            str(r.prompt_tokens - r.cached_tokens),
            f"{r.ttft_s * 1000:.0f}",
        )

    summary = Table(
        title="What the bank saved", title_justify="left", show_header=False, box=box.SIMPLE
    )
    summary.add_column(style="bold", no_wrap=True)
    summary.add_column(justify="right", no_wrap=True)
    ratio = report.snapshot_bytes / report.bank_stored_bytes if report.bank_stored_bytes else 0.0
    prompt = sum(r.prompt_tokens for r in report.rows)
    cached = sum(r.cached_tokens for r in report.rows)
    others = _median([r.ttft_s for r in report.rows[1:]])
    for name, value in [
        ("bank: KV blocks + GDN states", _size(report.bank_stored_bytes)),
        ("bank: directory on disk", _size(report.bank_disk_bytes)),
        ("per-session snapshots", _size(report.snapshot_bytes)),
        ("  (save_prompt_cache, 1 per agent)", f"{report.snapshot_tokens} tokens"),
        ("snapshots / bank", f"{ratio:.2f}x"),
        ("hit rate (cached / prompt)", f"{report.hit_rate:.1%} ({cached}/{prompt})"),
        ("TTFT, first request (cold)", f"{report.rows[0].ttft_s * 1000:.0f} ms"),
        ("TTFT, median of the others", f"{others * 1000:.0f} ms"),
        ("restart: stop, rebuild, reopen", f"{report.restart_s:.2f} s"),
    ]:
        summary.add_row(name, value)
    return [turns, summary]


def _size(n: int) -> str:
    return f"{n / (1 << 20):.2f} MiB" if n >= 1 << 20 else f"{n / 1024:.1f} KiB"


def _median(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2
