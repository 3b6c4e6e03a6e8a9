"""Run one provider on one case and hold it to the float64 CPU oracle.

Steps: build the master inputs (float64, CPU) from a seed; round them to the run dtype and move them to the
provider's device (args the op table pins to float32 stay float32); the oracle gets those same rounded values
back in float64 on the CPU. Then compare every output tensor with its own tolerance, the addressed rows of
every in-place state with the state tolerance, and every row not addressed bit for bit against its old
contents (NaN-poisoned, so a stray read shows up in the outputs and a stray write here).
"""
from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from conformance.cases import Case, OpCall, build
from conformance.tolerances import EXACT, ROUTE_TIE_RTOL, Tolerance, tolerance
from k3core.backend import OpSpec, Provider, load_backend, providers
from k3core.config import ModelConfig
from k3core.ops import op_info
from kernels.torch.moe import route_scores, route_weights


@dataclass
class TensorCheck:
    output: str
    passed: bool
    worst: float                 # max error / bound (<= 1 passes); inf for a NaN or shape mismatch
    max_abs_error: float
    detail: str


@dataclass
class CaseResult:
    op: str
    case: str
    provider: str
    dtype: str
    status: str                  # "passed" | "failed" | "skipped" | "error"
    seed: int
    checks: list[TensorCheck]
    reason: str = ""
    seconds: float = 0.0

    @property
    def worst(self) -> float:
        return max((c.worst for c in self.checks), default=0.0)


# ---- moving arguments -------------------------------------------------------------------------------------
def _convert(value: Any, dtype: torch.dtype, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device=device, dtype=dtype if value.is_floating_point() else value.dtype)
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(_convert(v, dtype, device) for v in value))
    return value


def provider_args(call: OpCall, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    cpu = torch.device("cpu")
    return {name: _convert(value, torch.float32 if name in call.pinned_float32 else dtype,
                           cpu if name in call.on_host else device)
            for name, value in call.args.items()}


def oracle_args(rounded: dict[str, Any]) -> dict[str, Any]:
    return {name: _convert(value, torch.float64, torch.device("cpu")) for name, value in rounded.items()}


def _clone(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}


def named_outputs(op: str, result: Any) -> dict[str, torch.Tensor]:
    if isinstance(result, tuple) and hasattr(result, "_fields"):
        outputs = dict(result._asdict())
    else:
        outputs = {"out": result}
    if op == "moe_route":      # top-k order is not part of the contract: compare per-token sets, sorted by id
        order = outputs["expert_ids"].argsort(dim=-1)
        outputs = {"weights": outputs["weights"].gather(-1, order),
                   "expert_ids": outputs["expert_ids"].gather(-1, order)}
    return outputs


def resolve_route_ties(got: dict[str, torch.Tensor], oracle: dict[str, torch.Tensor],
                       oracle_in: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The oracle's routing (named_outputs: per-token ids sorted, weights in that order), except for tokens where
    the provider chose other experts that tie with the oracle's at the top-k boundary: every expert in one set and
    not the other has a float64 choice score within ROUTE_TIE_RTOL of the oracle's k-th. For those tokens the oracle
    takes the provider's experts and its own float64 weights for them, so the exact id check and the weight
    tolerance still apply; a swap across a real gap stays a mismatch."""
    got_ids = got["expert_ids"].detach().cpu().to(torch.int64)
    want_ids = oracle["expert_ids"]
    differ = (got_ids != want_ids).any(dim=-1).nonzero().flatten().tolist() if got_ids.shape == want_ids.shape else []
    if not differ:
        return oracle
    scores, choice = route_scores(oracle_in["logits"], oracle_in["correction_bias"], oracle_in["scoring"])
    top_k = want_ids.shape[-1]
    boundary = choice.topk(top_k, dim=-1).values[:, -1]                        # [T] the k-th choice score
    ids, weights = want_ids.clone(), oracle["weights"].clone()
    for t in differ:
        chosen = set(got_ids[t].tolist())
        if len(chosen) != top_k or not chosen <= set(range(choice.shape[-1])):
            continue                                                           # repeated or unknown experts
        swapped = torch.tensor(sorted(chosen ^ set(want_ids[t].tolist())))
        if bool(((choice[t, swapped] - boundary[t]).abs() <= ROUTE_TIE_RTOL * boundary[t].abs()).all()):
            ids[t] = got_ids[t]
            weights[t] = route_weights(scores[t:t + 1], got_ids[t:t + 1], oracle_in["renormalize"],
                                       oracle_in["routed_scaling_factor"])[0]
    return {"weights": weights, "expert_ids": ids}


# ---- comparison -------------------------------------------------------------------------------------------
def compare(name: str, got: torch.Tensor, want: torch.Tensor, tol: Tolerance | str) -> TensorCheck:
    got = got.detach().cpu()
    if tuple(got.shape) != tuple(want.shape):
        return TensorCheck(name, False, float("inf"), float("inf"), f"shape {tuple(got.shape)} != {tuple(want.shape)}")
    if tol == EXACT:
        mismatches = int((got.to(want.dtype) != want).sum())
        return TensorCheck(name, mismatches == 0, 0.0 if mismatches == 0 else float("inf"), float(mismatches),
                           f"{mismatches} mismatching entries" if mismatches else "exact")
    got64 = got.double()
    bad_nan = int((torch.isnan(got64) & ~torch.isnan(want)).sum())
    if bad_nan:
        return TensorCheck(name, False, float("inf"), float("nan"), f"{bad_nan} NaN where the oracle is finite")
    if got64.numel() == 0:
        return TensorCheck(name, True, 0.0, 0.0, "empty")
    error = (got64 - want).abs()
    bound = tol.atol + tol.rtol * want.abs()
    ratio = torch.where(bound > 0, error / bound, torch.where(error > 0, float("inf"), 0.0))
    worst = float(ratio.max())
    return TensorCheck(name, worst <= 1.0, worst, float(error.max()),
                       f"max abs error {float(error.max()):.3g} (atol {tol.atol:g}, rtol {tol.rtol:g})")


def check_inplace(op: str, name: str, before: torch.Tensor, after: torch.Tensor, oracle_after: torch.Tensor,
                  rows: torch.Tensor, dtype: torch.dtype, memory: str = "short") -> list[TensorCheck]:
    after = after.detach().cpu()
    rows = rows.cpu()
    addressed = compare(name, after[rows], oracle_after[rows], tolerance(op, name, dtype, memory))
    untouched = torch.ones(after.shape[0], dtype=torch.bool)
    untouched[rows] = False
    old, new = before.cpu()[untouched], after[untouched]
    same = bool(torch.equal(torch.isnan(old), torch.isnan(new)) and
                torch.equal(torch.nan_to_num(old, nan=0.0), torch.nan_to_num(new, nan=0.0)))
    return [addressed, TensorCheck(f"{name} (slots not addressed)", same, 0.0 if same else float("inf"), 0.0,
                                   "untouched" if same else "a slot the call does not address was written")]


# ---- one case ---------------------------------------------------------------------------------------------
def spec_for(dtype: torch.dtype, device: torch.device) -> OpSpec:
    return OpSpec(config=ModelConfig.preset("k3-tiny"), dtype=dtype, device=device)


def why_not(provider: Provider, dtype: torch.dtype, device: torch.device) -> str:
    unavailable = provider.available()
    if unavailable:
        return unavailable
    return "; ".join(provider.reasons_unsupported(spec_for(dtype, device)))


def run_case(case: Case, provider: Provider, dtype: torch.dtype, device: torch.device, seed: int) -> CaseResult:
    dtype_name = str(dtype).removeprefix("torch.")
    result = CaseResult(case.op, case.case_id, provider.name, dtype_name, "skipped", seed, [])
    reason = why_not(provider, dtype, device) or case.params.get("not_for", {}).get(dtype_name, "")
    if reason:
        result.reason = reason
        return result
    started = time.perf_counter()
    memory = case.params.get("memory", "short")
    try:
        gen = torch.Generator().manual_seed(seed)
        call = build(case, gen)
        rounded = provider_args(call, dtype, device)
        before = {name: rounded[name].clone() for name in call.inplace}
        oracle_in = oracle_args(rounded)
        oracle_fn = Provider(case.op, "oracle", "torch", 0, op_info(case.op).reference).load()
        oracle_out = named_outputs(case.op, oracle_fn(**oracle_in))
        got = named_outputs(case.op, provider.load()(**rounded))
        if case.op == "moe_route":
            oracle_out = resolve_route_ties(got, oracle_out, oracle_in)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        for name, want in oracle_out.items():
            if name not in got:
                result.checks.append(TensorCheck(name, False, float("inf"), 0.0, "output missing"))
                continue
            result.checks.append(compare(name, got[name], want, tolerance(case.op, name, dtype, memory)))
        for name, rows in call.inplace.items():
            result.checks += check_inplace(case.op, name, before[name], rounded[name], oracle_in[name], rows, dtype,
                                           memory)
        result.status = "passed" if all(c.passed for c in result.checks) else "failed"
    except Exception as exc:
        result.status = "error"
        result.reason = f"{type(exc).__name__}: {exc}"
        result.checks.append(TensorCheck("exception", False, float("inf"), 0.0,
                                         traceback.format_exc(limit=3).strip().splitlines()[-1]))
    result.seconds = time.perf_counter() - started
    return result


def backend_providers(backend: str, op: str) -> list[Provider]:
    load_backend(backend)
    return [p for p in providers(op) if p.backend == backend]


def default_device(backend: str) -> torch.device:
    return torch.device("cuda") if backend != "torch" and torch.cuda.is_available() else torch.device("cpu")
