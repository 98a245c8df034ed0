"""Cost of evaluating 100 routing rules (CEL) per request, as the agent's processor does.

The rule set mixes the forms operators write (see docs/rules.md): header-and-adapter
conjunctions, source CIDRs, tenant-or-adapter disjunctions, time windows and header macros.
Requests carry a dozen Envoy-style headers and are drawn at random so that some match early,
some late and many match nothing (a request that matches nothing evaluates all 100 rules,
the worst case). Each request is timed alone with ``perf_counter_ns`` around
``Evaluator.evaluate``. The same requests run through three evaluators in one process, one
after the other: ``indexed`` (as shipped: the rule index picks the candidate rules, each is
screened in Python, then CEL if the screen cannot tell), ``linear`` (``index=False``: every
rule's screen in order, the index's reference) and ``cel_only`` (linear, screens off: CEL for
every rule). Indexed and linear must give the same outcome for every request; the bench checks
that before it writes anything.

    .venv/bin/python bench/bench_rules.py [--requests 20000] [--out bench/results/rules_cpu.json]
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from _results import provenance, write_results

from adaptermesh.rules import Evaluator, Outcome, RequestFacts, compile_rule_set, parse_rule_set
from adaptermesh.rules.guards import Screen
from adaptermesh.rules.index import members

N_RULES = 100


def rule_document() -> dict[str, object]:
    rules: list[dict[str, object]] = []
    for i in range(N_RULES):
        kind = i % 5
        if kind == 0:
            when = f'request.headers["x-tier"] == "tier{i}" && adapter.startsWith("fin-{i}-")'
            action: dict[str, object] = {"shard": f"s{i}"}
        elif kind == 1:
            when = f'inCidr(request.source_ip, "10.{i}.0.0/16")'
            action = {"shard": f"s{i}"}
        elif kind == 2:
            when = f'request.tenant == "tenant{i}" || adapter == "adapter{i}"'
            action = {"adapter_version": f"2.{i}.0"}
        elif kind == 3:
            when = f'request.tenant == "tenant{i}" && now.getHours() >= 0'
            action = {"priority": i % 10}
        else:
            when = (
                f'"x-debug-{i}" in request.headers && '
                f'request.headers.exists(k, k.startsWith("x-block-{i}"))'
            )
            action = {"reject": {"status": 403, "message": f"blocked by rule {i}"}}
        rules.append({"name": f"rule-{i}", "when": when, **action})
    return {"rules": rules, "budget": {"max_rules": N_RULES, "max_us": 10_000}}


def requests(n: int, rng: random.Random) -> list[RequestFacts]:
    base = {
        ":method": "POST",
        ":path": "/v1/completions",
        ":authority": "mesh.local",
        ":scheme": "http",
        "content-type": "application/json",
        "user-agent": "openai-python",
        "accept": "application/json",
        "x-request-id": "0",
        "x-forwarded-proto": "http",
        "content-length": "120",
        "authorization": "Bearer x",
        "x-envoy-expected-rq-timeout-ms": "60000",
    }
    out = []
    for k in range(n):
        i = rng.randrange(N_RULES * 2)  # half the picks name no rule's values
        headers = dict(base, **{"x-request-id": str(k), "x-tier": f"tier{i}"})
        if rng.random() < 0.1:
            headers[f"x-debug-{i}"] = "1"
            headers[f"x-block-{i}"] = "1"
        out.append(
            RequestFacts(
                source_ip=f"10.{i % 256}.{rng.randrange(256)}.{rng.randrange(1, 255)}"
                if rng.random() < 0.3
                else f"172.16.{rng.randrange(256)}.{rng.randrange(1, 255)}",
                tenant=f"tenant{i}" if rng.random() < 0.5 else "tenant-x",
                headers=headers,
                adapter=f"fin-{i}-risk" if rng.random() < 0.5 else f"adapter{rng.randrange(400)}",
            )
        )
    return out


def percentiles(ns: list[int]) -> dict[str, float]:
    s = sorted(ns)

    def at(q: float) -> float:
        return round(s[min(len(s) - 1, int(q * len(s)))] / 1000, 2)

    return {
        "p50_us": at(0.50),
        "p90_us": at(0.90),
        "p99_us": at(0.99),
        "max_us": at(1.0),
        "mean_us": round(statistics.fmean(s) / 1000, 2),
    }


def run(evaluator: Evaluator, reqs: list[RequestFacts]) -> tuple[list[int], list[Outcome]]:
    times, outcomes = [], []
    clock = time.perf_counter_ns
    for r in reqs:
        t0 = clock()
        out = evaluator.evaluate(r)
        times.append(clock() - t0)
        outcomes.append(out)
    return times, outcomes


def same(a: Outcome, b: Outcome) -> bool:
    return (a.action, a.rule, a.errors, a.over_budget) == (
        b.action,
        b.rule,
        b.errors,
        b.over_budget,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    ap.add_argument("--requests", type=int, default=20_000)
    ap.add_argument("--warmup", type=int, default=2_000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--out", default="bench/results/rules_cpu.json")
    args = ap.parse_args()

    load_start = os.getloadavg()[0]
    compiled = compile_rule_set(parse_rule_set(rule_document()))
    cel_only = dataclasses.replace(
        compiled,
        screens=tuple(Screen(None, False) for _ in compiled.programs),
        whole_headers=tuple(True for _ in compiled.programs),
    )
    rng = random.Random(args.seed)
    warm, reqs = requests(args.warmup, rng), requests(args.requests, rng)
    results: dict[str, object] = {}
    outcomes: dict[str, list[Outcome]] = {}
    for label, c, indexed in (
        ("indexed", compiled, True),
        ("linear", compiled, False),
        ("cel_only", cel_only, False),
    ):
        ev = Evaluator(c, index=indexed)
        run(ev, warm)
        times, outs = run(ev, reqs)
        outcomes[label] = outs
        no_match = [t for t, o in zip(times, outs, strict=True) if o.rule is None]
        results[label] = {
            "all_requests": percentiles(times),
            "no_match_requests": percentiles(no_match) if no_match else None,
            "no_match_share": round(len(no_match) / len(times), 3),
            "rules_evaluated_mean": round(statistics.fmean(o.evaluated for o in outs), 1),
            "rules_evaluated_max": max(o.evaluated for o in outs),
            "over_budget": ev.stats.over_budget,
        }
    # A request over the time budget (a descheduled process on a shared box) ends in the
    # fallback in one evaluator and not the other; the outcomes must agree on all the rest.
    disagree = sum(
        not same(a, b)
        for a, b in zip(outcomes["indexed"], outcomes["linear"], strict=True)
        if not (a.over_budget or b.over_budget)
    )
    if disagree:
        sys.exit(f"indexed and linear evaluators disagree on {disagree} requests")
    results["indexed_equals_linear"] = True
    # The two costs the screens avoid: building one request's CEL activation (every header,
    # as a rule that reads the whole map gets) and one CEL call on it.
    ev = Evaluator(compiled)
    sample = reqs[: min(len(reqs), 5000)]
    t0 = time.perf_counter_ns()
    now = datetime.datetime.now(datetime.UTC)
    contexts = [ev._context(r, True, now) for r in sample]
    activation_us = (time.perf_counter_ns() - t0) / len(sample) / 1000
    program = compiled.programs[2]  # request.tenant == "..." || adapter == "..."
    t0 = time.perf_counter_ns()
    for ctx in contexts:
        program.execute(ctx)
    call_us = (time.perf_counter_ns() - t0) / len(sample) / 1000
    # The index's own cost per request: its lookups and the candidate list.
    index = compiled.index
    t0 = time.perf_counter_ns()
    for r in sample:
        members(index.candidates(r.source_ip, r.tenant, r.headers, r.adapter, now.hour))
    results["index_lookup_mean_us"] = round((time.perf_counter_ns() - t0) / len(sample) / 1000, 2)
    results["cel_activation_mean_us"] = round(activation_us, 2)
    results["cel_call_mean_us"] = round(call_us, 2)
    screens = compiled.screens
    out = {
        "bench": "bench_rules",
        "rules": N_RULES,
        "requests": args.requests,
        "rules_decided_in_python": sum(s.complete for s in screens),
        "rules_screened_then_cel": sum(s.decide is not None and not s.complete for s in screens),
        "rules_cel_only": sum(s.decide is None for s in screens),
        "rules_found_by_index": compiled.index.indexed,
        "rules_always_candidates": compiled.index.rules - compiled.index.indexed,
        "target_p99_us": 50,
        "results": results,
        **provenance("common-expression-language", load_start=load_start),
    }
    write_results(args.out, out)


if __name__ == "__main__":
    main()
