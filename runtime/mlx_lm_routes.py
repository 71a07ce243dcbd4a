"""The GET routes `cas-bank mlx-lm-server` answers itself, beside mlx-lm's own.

- `/health`: mlx-lm's (`ok`, or 503 `unavailable` once its generation thread died),
  plus the bank and the shared tier: `degraded` (still 200: answers go out) with the
  reason while the bank refuses stores or the shared tier does not serve
  (`cas_bank.remote.health`); `bank_in_use` (always true: with `--draft-model` too,
  whose caches the bank keeps beside the model's, `draft_model`), and the tier's
  state under `remote`.
- `/metrics`: Prometheus text of the bank's counters, where restores spent their time,
  the prompt cache's counters (a draft model's among them: `draft_bytes_written`,
  `trimmed_tokens`), `bank_in_use` (1) and the shared tier's state (mlx-lm has no
  metrics).
- `/v1/models`: the model served; with `--allow-model-switching` also the mlx-lm
  models in the local Hugging Face cache as mlx-lm lists them (a server pinned to its
  model lists no others: they are not a caller's to probe). The listing is made before
  any byte is sent, so a cache that cannot be read (none yet: mlx-lm raised after its
  200 header) drops only that part.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from cas_bank.bank import Bank
from cas_bank.remote.health import TierProbe, degraded_reason

from .metrics import (
    CONTENT_TYPE,
    Metric,
    bank_metrics,
    render,
    restore_metrics,
    tenant_metrics,
    tier_metrics,
)
from .mlx_lm_requests import served_model_id

log = logging.getLogger("cas_bank.mlx_lm")

# Files mlx-lm requires of a Hugging Face cache entry to list it as a model.
_MODEL_FILES = ("config.json", "model.safetensors.index.json", "tokenizer_config.json")


def send_json(handler: Any, status: int, body: Any) -> None:
    data = json.dumps(body).encode()
    handler._set_completion_headers(status)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
    handler.wfile.flush()


def health(handler: Any, bank: Bank, tier: TierProbe | None, *, draft_model: bool = False) -> None:
    alive = bool(handler.response_generator.is_healthy)
    remote = tier.check() if tier is not None else None
    degraded = degraded_reason(bank.degraded, remote)
    status = "unavailable" if not alive else "ok" if degraded is None else "degraded"
    body = {
        "status": status,
        "degraded": degraded,
        "bank_in_use": True,
        "draft_model": draft_model,
        "remote": None if remote is None else remote.as_dict(),
        "bank": str(bank.path),
        "block_size": bank.config.block_size,
    }
    send_json(handler, 200 if alive else 503, body)


def metrics(
    handler: Any,
    bank: Bank,
    tier: TierProbe | None,
    cache_stats: dict[str, int],
) -> None:
    families = [*bank_metrics(bank.stats()), *restore_metrics(bank.restore_times())]
    families += tenant_metrics(bank.tenant_stats())
    families.append(
        Metric.single(
            "bank_degraded",
            "1 while the bank refuses stores (a full disk); answers still go out.",
            "gauge",
            0 if bank.degraded is None else 1,
        )
    )
    families.append(
        Metric.single(
            "bank_in_use",
            "1: the bank is the prompt cache (with --draft-model too: the draft model's "
            "caches beside the model's).",
            "gauge",
            1,
        )
    )
    families += [
        Metric.single(
            f"prompt_cache_{k}_total", f"BankPromptCache: {k} (this process).", "counter", v
        )
        for k, v in cache_stats.items()
    ]
    if tier is not None:
        families += tier_metrics(tier.check(), tier)
    data = render(families).encode()
    handler.send_response(200)
    handler.send_header("Content-Type", CONTENT_TYPE)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)
    handler.wfile.flush()


def models(handler: Any, scan_cache_dir: Any, *, others: bool) -> None:
    """mlx-lm's `/v1/models[/repo]`, its listing made before anything is sent; `others`:
    list the local Hugging Face cache's models too (a server that may switch to them)."""
    wanted = "/".join(handler.path.split("/")[3:]) or None
    created = handler.created
    listed: list[dict[str, Any]] = []
    try:
        repos = scan_cache_dir().repos if others else []
    except Exception as e:  # no Hugging Face cache (yet), or one that cannot be read
        log.info("cas-bank mlx-lm-server: /v1/models lists no cached models: %s", e)
        repos = []
    for repo in repos:
        if _is_mlx_model(repo) and (wanted is None or repo.repo_id == wanted):
            listed.append({"id": repo.repo_id, "object": "model", "created": created})
    served = served_model_id(handler.response_generator.cli_args.model)
    ids = {m["id"] for m in listed}
    if served is not None and served not in ids and wanted in (None, served):
        listed.append({"id": served, "object": "model", "created": created})
    send_json(handler, 200, {"object": "list", "data": listed})


def _is_mlx_model(repo: Any) -> bool:
    if repo.repo_type != "model" or "main" not in repo.refs:
        return False
    names = {f.file_path.name for f in repo.refs["main"].files}
    return all(f in names for f in _MODEL_FILES)
