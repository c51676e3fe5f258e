"""Model router evaluation (`tokenfleet models route`): does a cheap-feature classifier pick the small model where it agrees
with the big one, better than a random mix at the same cost?

Stages (each writes a committed file; later stages read the earlier ones):

  prompts  benchmarks/data/router_prompts.jsonl: a fixed, generated set of chat requests of several kinds
           (facts, arithmetic, completions, translation, lists, explanations, code, JSON, tools, long context)
  label    benchmarks/data/router_labels.json: each prompt's greedy answer from the small model
           (SmolLM2-135M-Instruct) and the big one (Gemma-3-270M), agreement by
           tokenfleet.routing.model_router.answers_agree, and each model's measured seconds per prompt token and
           per output token here (batch 1), which price every request
  eval     trains the classifier on one half (seeded split), evaluates on the other: cost and agreement with
           the big model for always-small, always-big, random mixes and the router at several thresholds;
           writes the report and benchmarks/data/router_policy.json (a policy for `tokenfleet models route`)

    .venv/bin/python benchmarks/model_router.py prompts
    .venv/bin/python benchmarks/model_router.py label --threads 2      # ~10 min here
    .venv/bin/python benchmarks/model_router.py eval
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from tokenfleet.engine.request_spec import RequestSpec

DATA = Path(__file__).parent / "data"
PROMPTS = DATA / "router_prompts.jsonl"
LABELS = DATA / "router_labels.json"
POLICY = DATA / "router_policy.json"
REPORTS = Path(__file__).parent / "reports"

COUNTRIES = ["France", "Germany", "Italy", "Spain", "Japan", "China", "India", "Brazil", "Canada", "Egypt", "Kenya",
             "Peru", "Norway", "Sweden", "Poland", "Greece", "Turkey", "Mexico", "Chile", "Ireland", "Portugal",
             "Austria", "Hungary", "Finland", "Vietnam", "Thailand", "Argentina", "Australia", "Nigeria", "Morocco"]
PHRASES = ["good morning", "thank you very much", "where is the station", "I like apples", "the cat is black",
           "see you tomorrow", "how much does it cost", "the weather is nice today", "I am hungry", "open the door",
           "my name is Anna", "the book is on the table", "we are going home", "it is very cold", "happy birthday",
           "the water is warm", "I need a doctor", "the train is late", "she reads a letter", "good night",
           "the house is big", "he drinks coffee", "I love music", "the shop is closed", "where are you from"]
SAYINGS = ["The early bird catches the", "Actions speak louder than", "A picture is worth a thousand",
           "Better late than", "When in Rome, do as the", "The pen is mightier than the", "Practice makes",
           "Rome was not built in a", "An apple a day keeps the", "All that glitters is not", "Time is",
           "Knowledge is", "Honesty is the best", "Where there is a will, there is a", "Two wrongs don't make a",
           "The grass is always greener on the other side of the", "Don't count your chickens before they",
           "Every cloud has a silver", "Laughter is the best", "Curiosity killed the"]
LIST_TOPICS = ["fruits", "colors", "planets", "musical instruments", "European countries", "programming languages",
               "mammals", "vegetables", "sports", "birds", "rivers", "metals", "flowers", "oceans", "car brands",
               "kitchen tools", "board games", "languages spoken in Europe", "primary colors", "dog breeds"]
EXPLAIN = ["the sky is blue", "ice floats on water", "leaves change color in autumn", "we have seasons",
           "bread rises", "the moon has phases", "metal feels cold", "planes can fly", "the sea is salty",
           "we need sleep", "rainbows form", "magnets attract iron", "volcanoes erupt", "stars twinkle",
           "onions make us cry", "the heart beats faster when we run", "tides happen", "soap cleans",
           "compound interest grows money", "vaccines work"]
CODE = ["reverses a string", "checks whether a number is prime", "returns the factorial of n",
        "counts the vowels in a string", "merges two sorted lists", "finds the largest number in a list",
        "removes duplicates from a list", "computes the n-th Fibonacci number", "checks whether a word is a palindrome",
        "converts Celsius to Fahrenheit", "sums the digits of an integer", "flattens a nested list",
        "sorts a list of tuples by their second element", "returns the most common word in a text",
        "validates an email address with a regex", "reads a CSV file and prints each row", "computes the mean of a list",
        "capitalizes every word in a sentence", "returns the intersection of two sets", "counts lines in a file"]
PEOPLE = [("Alice", 31), ("Bob", 45), ("Chen", 28), ("Dana", 52), ("Emil", 19), ("Fatima", 37), ("Goran", 60),
          ("Hana", 24), ("Ivan", 41), ("Julia", 33), ("Kofi", 29), ("Lena", 48), ("Mateo", 22), ("Nora", 56),
          ("Omar", 38), ("Pia", 27), ("Quinn", 44), ("Rosa", 35), ("Sam", 50), ("Tara", 26)]
STORIES = [
    ("Mara keeps bees on the roof of her apartment building in Lisbon. Every spring she sells the honey at the "
     "Saturday market near the river, and she gives a jar to each neighbour who lets her use the stairs.",
     ["Where does Mara keep her bees?", "In which city does Mara live?", "On which day is the market?",
      "What does Mara give her neighbours?"]),
    ("The village library opened in 1952 with three hundred books donated by a retired teacher. Today it lends "
     "twelve thousand books a year and runs a chess club every Thursday evening.",
     ["When did the library open?", "Who donated the first books?", "How many books does it lend a year?",
      "When does the chess club meet?"]),
    ("Tomas trained for two years to cross the Alps by bicycle. He left Munich on a Monday in July, crossed three "
     "passes, and reached Verona six days later with a broken spoke and a sunburn.",
     ["Where did Tomas start?", "Where did he arrive?", "How many days did the trip take?",
      "What broke on his bicycle?"]),
    ("The research ship Aurora spent four months mapping the seabed south of Iceland. Its sonar found a chain of "
     "underwater volcanoes, the tallest rising two kilometres above the ocean floor.",
     ["What was the ship called?", "How long did the survey take?", "What did the sonar find?",
      "How tall was the tallest volcano?"]),
    ("At the bakery on Elm Street, the first loaves come out of the oven at five in the morning. The owner, Ruth, "
     "uses a sourdough starter that her grandmother brought from Poland in 1961.",
     ["What street is the bakery on?", "When do the first loaves come out?", "Who owns the bakery?",
      "Where did the starter come from?"]),
]


def make_prompts() -> list[dict]:
    rng = random.Random(22)
    rows: list[dict] = []

    def add(kind: str, text: str, system: str = "", **extra: object) -> None:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
        rows.append({"kind": kind, "messages": messages, "tools": False, "json": False, "max_tokens": 24,
                     "tier": rng.choice(["interactive", "interactive", "batch"]), **extra})

    for c in COUNTRIES:
        add("fact", f"What is the capital of {c}?")
    for _ in range(30):
        a, b = rng.randint(2, 60), rng.randint(2, 40)
        op = rng.choice(["+", "-", "*"])
        add("math", rng.choice([f"What is {a} {op} {b}?", f"Calculate {a} {op} {b}.",
                                f"Compute {a} {op} {b}. Answer with a number."]))
    for s in SAYINGS:
        add("complete", f"Complete the saying: {s} ...")
    for p in PHRASES:
        add("translate", f"Translate to {rng.choice(['French', 'Spanish', 'German'])}: {p}")
    for t in LIST_TOPICS:
        add("list", f"List three {t}.")
    for e in EXPLAIN:
        add("explain", f"Explain why {e}.", max_tokens=rng.choice([64, 128, 256]))
    for c in CODE:
        add("code", f"Write a Python function that {c}.", max_tokens=rng.choice([128, 256, 512]))
    for name, age in PEOPLE:
        add("json", f"Return a JSON object with the keys name and age for {name}, who is {age}.", json=True)
    for story, questions in STORIES:
        for q in questions:
            add("context", f"Read the text and answer the question.\n\nText: {story}\n\nQuestion: {q}",
                system="You answer questions about a text in a few words.")
    for i in range(20):
        city = rng.choice(COUNTRIES)
        add("tools", f"What's the weather like in the capital of {city} today?", tools=True,
            system="You can call the get_weather tool.")
        if i % 2:
            rows[-1]["messages"].insert(1, {"role": "user", "content": "Hi! I'm planning a trip."})
            rows[-1]["messages"].insert(2, {"role": "assistant", "content": "Great, where are you going?"})
    for i, row in enumerate(rows):
        row["id"] = f"p{i:03d}"
    return rows


def route_input(row: dict):
    from tokenfleet.routing.model_router import RouteInput

    return RouteInput(messages=[(m["role"], m["content"]) for m in row["messages"]], tools=row["tools"],
                      json_mode=row["json"], tier=row["tier"], max_tokens=row["max_tokens"])


def label(args: argparse.Namespace) -> None:
    from tokenfleet.engine.sampling_params import SamplingParams
    from tokenfleet.llm import LLM
    from tokenfleet.models.gguf_import import ensure_default_model, ensure_model
    from tokenfleet.routing.model_router import answers_agree

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    out: dict = {"models": {}, "rows": {}}
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    base_params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, stop=["\n"])
    for role, path in (("small", ensure_default_model()), ("big", ensure_model("gemma3-270m"))):
        llm = LLM(str(path), dtype="bfloat16", num_threads=args.threads, max_num_running=32)
        t = time.perf_counter()
        if role == "small":  # the instruct model as served: its chat template
            answers = llm.chat([r["messages"] for r in rows], params)
        else:  # Gemma-3-270M is a base model: a few-shot question/answer prompt, its answer is the first line
            answers = llm.generate([few_shot(r["messages"]) for r in rows], base_params)
        batch_s = time.perf_counter() - t
        prefill, decode = measure_rates(llm, [r["messages"] for r in rows[:: max(1, len(rows) // args.timing_prompts)]],
                                        params)
        out["models"][role] = {"path": str(path), "name": path.name, "seconds_per_prompt_token": prefill,
                               "seconds_per_output_token": decode, "batched_seconds": batch_s}
        print(f"{role}: {path.name}: {1 / prefill:.0f} prompt tok/s, {1 / decode:.1f} output tok/s at batch 1; "
              f"all {len(rows)} prompts batched in {batch_s:.0f} s", flush=True)
        for r, a in zip(rows, answers):
            out["rows"].setdefault(r["id"], {})[role] = {"text": a.text, "prompt_tokens": len(a.prompt_token_ids),
                                                         "output_tokens": len(a.token_ids)}
        del llm
    for r in rows:
        entry = out["rows"][r["id"]]
        entry["agree"] = answers_agree(entry["small"]["text"], entry["big"]["text"])
    out["max_tokens"] = args.max_tokens
    LABELS.write_text(json.dumps(out, indent=1, ensure_ascii=False))
    rate = sum(e["agree"] for e in out["rows"].values()) / len(rows)
    print(f"labels: {rate:.1%} of {len(rows)} prompts easy (the small model agrees)")


def rates(args: argparse.Namespace) -> None:
    """Re-measure the two models' batch-1 rates into the labels file (on a quiet machine: the answers stay)."""
    from tokenfleet.engine.sampling_params import SamplingParams
    from tokenfleet.llm import LLM

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    labels = json.loads(LABELS.read_text())
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0)
    sample = [r["messages"] for r in rows[:: max(1, len(rows) // args.timing_prompts)]]
    for role, m in labels["models"].items():
        llm = LLM(m["path"], dtype="bfloat16", num_threads=args.threads)
        measure_rates(llm, sample[:2], params)  # warm-up
        m["seconds_per_prompt_token"], m["seconds_per_output_token"] = measure_rates(llm, sample, params)
        print(f"{role}: {1 / m['seconds_per_prompt_token']:.0f} prompt tok/s, {1 / m['seconds_per_output_token']:.1f} "
              "output tok/s", flush=True)
    LABELS.write_text(json.dumps(labels, indent=1, ensure_ascii=False))


FEW_SHOT = ("Answer each question briefly.\n\nQ: What is the capital of Italy?\nA: Rome\n\n"
            "Q: Translate to Spanish: thank you\nA: gracias\n\nQ: List three animals.\nA: dog, cat, horse\n\n")


def few_shot(messages: list[dict]) -> str:
    """A chat request as a base model's completion prompt."""
    context = " ".join(m["content"] for m in messages if m["role"] == "system")
    turns = [m["content"].replace("\n\n", "\n") for m in messages if m["role"] != "system"]
    question = " ".join(turns[-1:])
    prefix = (context + "\n\n") if context else ""
    return f"{prefix}{FEW_SHOT}Q: {question}\nA:"


def measure_rates(llm, conversations: list, params) -> tuple[float, float]:
    """Seconds per prompt token (first step) and per output token (later steps), one request at a time."""
    from tokenfleet.api.chat_template import render_chat

    prompt_s = prompt_n = decode_s = decode_n = 0.0
    for messages in conversations:
        tokens = llm.tokenizer.encode(render_chat(llm.tokenizer, messages))
        rid = llm.core.add_request(RequestSpec(tokens, params))
        first = True
        while llm.core.has_unfinished():
            t = time.perf_counter()
            outs = llm.core.step()
            dt = time.perf_counter() - t
            if first:
                prompt_s, prompt_n, first = prompt_s + dt, prompt_n + len(tokens), False
            else:
                decode_s, decode_n = decode_s + dt, decode_n + sum(len(o.new_token_ids) for o in outs if o.request_id == rid)
    return prompt_s / prompt_n, decode_s / max(decode_n, 1)


def evaluate(args: argparse.Namespace) -> None:
    from tokenfleet.routing.model_router import Classifier, RoutePolicy, features

    rows = [json.loads(line) for line in PROMPTS.read_text().splitlines()]
    labels = json.loads(LABELS.read_text())
    models = labels["models"]

    def cost(row: dict, role: str) -> float:
        """Seconds serving this request takes on that model here at batch 1: its prompt on that model, and the same
        output length on both (the labelling's token budget: the base model's answers stop at a newline, which
        would make it look cheap for the wrong reason)."""
        r, m = labels["rows"][row["id"]][role], models[role]
        return r["prompt_tokens"] * m["seconds_per_prompt_token"] + labels["max_tokens"] * m["seconds_per_output_token"]

    order = list(range(len(rows)))
    random.Random(args.seed).shuffle(order)
    half = len(order) // 2
    train = [rows[i] for i in order[:half]]
    test = [rows[i] for i in order[half:]]
    easy = {r["id"]: labels["rows"][r["id"]]["agree"] for r in rows}
    clf = Classifier.train([features(route_input(r)) for r in train], [easy[r["id"]] for r in train])

    def summary(rs: list[dict], small: list[bool]) -> dict:
        total = sum(cost(r, "small" if s else "big") for r, s in zip(rs, small))
        agree = sum(1.0 if not s else float(easy[r["id"]]) for r, s in zip(rs, small))
        return {"cost_s": total / len(rs), "agreement": agree / len(rs), "small_share": sum(small) / len(rs)}

    def curve(rs: list[dict]) -> dict:
        probs = [clf.probability(features(route_input(r))) for r in rs]
        always_small = summary(rs, [True] * len(rs))
        always_big = summary(rs, [False] * len(rs))
        router = {f"{t:.2f}": summary(rs, [p >= t for p in probs]) for t in [i / 20 for i in range(1, 20)]}
        return {"always_small": always_small, "always_big": always_big, "router": router}

    def random_mix(c: dict, share_small: float) -> dict:
        """A random mix sending a share of requests to the small model: expected cost and agreement."""
        s, b = c["always_small"], c["always_big"]
        return {"cost_s": share_small * s["cost_s"] + (1 - share_small) * b["cost_s"],
                "agreement": share_small * s["agreement"] + (1 - share_small) * b["agreement"], "small_share": share_small}

    def equal_cost_mix(c: dict, cost_s: float) -> dict:
        s, b = c["always_small"], c["always_big"]
        share = min(max((b["cost_s"] - cost_s) / (b["cost_s"] - s["cost_s"]), 0.0), 1.0)
        return random_mix(c, share)

    train_curve, test_curve = curve(train), curve(test)
    # the threshold: on the training half, the router point furthest above the random-mix line at equal cost
    best_t = max(train_curve["router"], key=lambda t: train_curve["router"][t]["agreement"]
                 - equal_cost_mix(train_curve, train_curve["router"][t]["cost_s"])["agreement"])
    chosen = test_curve["router"][best_t]
    mix = equal_cost_mix(test_curve, chosen["cost_s"])
    small_ref, big_ref = args.small_ref, args.big_ref
    policy = RoutePolicy(small_ref, big_ref, clf, float(best_t))
    POLICY.write_text(json.dumps(json.loads(policy.to_json()), indent=1, sort_keys=True) + "\n")
    result = {"max_tokens": labels["max_tokens"],
              "n_train": len(train), "n_test": len(test), "seed": args.seed, "threshold": float(best_t),
              "models": models, "easy_rate": {"train": sum(easy[r["id"]] for r in train) / len(train),
                                              "test": sum(easy[r["id"]] for r in test) / len(test)},
              "test": test_curve, "train": train_curve, "router_test": chosen, "random_mix_equal_cost": mix,
              "mixes_test": {f"{p:.1f}": random_mix(test_curve, p) for p in [i / 10 for i in range(11)]},
              "weights": clf.weights, "by_kind_test": by_kind(test, easy, clf)}
    stamp = time.strftime("%Y-%m-%d")
    (REPORTS / f"{stamp}-cpu-model-router.json").write_text(json.dumps(result, indent=1))
    (REPORTS / f"{stamp}-cpu-model-router.md").write_text(report(result))
    print(report(result))


def by_kind(rows: list[dict], easy: dict, clf) -> dict:
    from tokenfleet.routing.model_router import features

    out: dict = {}
    for r in rows:
        k = out.setdefault(r["kind"], {"n": 0, "easy": 0, "p": []})
        k["n"] += 1
        k["easy"] += easy[r["id"]]
        k["p"].append(clf.probability(features(route_input(r))))
    return {kind: {"n": v["n"], "easy_rate": v["easy"] / v["n"], "mean_p_small_agrees": statistics.mean(v["p"])}
            for kind, v in sorted(out.items())}


def report(r: dict) -> str:
    t = r["test"]
    m = r["models"]
    ratio = (m["big"]["seconds_per_output_token"] / m["small"]["seconds_per_output_token"])
    lines = [
        "## Model router on the held-out half", "",
        f"Small: {m['small']['name']} ({1 / m['small']['seconds_per_prompt_token']:.0f} prompt tok/s, "
        f"{1 / m['small']['seconds_per_output_token']:.1f} output tok/s at batch 1 here); big: {m['big']['name']} "
        f"({1 / m['big']['seconds_per_prompt_token']:.0f} prompt tok/s, {1 / m['big']['seconds_per_output_token']:.1f} "
        f"output tok/s; {ratio:.2f}x the small model's time per output token).",
        f"{r['n_train']} training and {r['n_test']} held-out prompts (seed {r['seed']}); easy (the small model's "
        f"answer agrees with the big one's) on {r['easy_rate']['train']:.1%} / {r['easy_rate']['test']:.1%}. "
        f"Cost: the request's seconds on the chosen model at the measured batch-1 rates (its prompt, plus "
        f"{r.get('max_tokens', 24)} output tokens on either model). Agreement: with the big model's answer (1 when "
        "the big model serves it).", "",
        "| policy | cost per request (s) | agreement with big | share to small |", "|---|---|---|---|",
        f"| always small | {t['always_small']['cost_s']:.3f} | {t['always_small']['agreement']:.1%} | 100% |",
        f"| always big | {t['always_big']['cost_s']:.3f} | {t['always_big']['agreement']:.1%} | 0% |",
    ]
    for p, mix in r["mixes_test"].items():
        if p not in ("0.0", "1.0"):
            lines.append(f"| random mix, {float(p):.0%} small | {mix['cost_s']:.3f} | {mix['agreement']:.1%} | {float(p):.0%} |")
    c, mix = r["router_test"], r["random_mix_equal_cost"]
    lines += [f"| **router (threshold {r['threshold']:.2f}, chosen on the training half)** | {c['cost_s']:.3f} | "
              f"**{c['agreement']:.1%}** | {c['small_share']:.0%} |",
              f"| random mix at the router's cost | {mix['cost_s']:.3f} | {mix['agreement']:.1%} | {mix['small_share']:.0%} |",
              "", f"Bar: at equal cost the router's agreement beats the best random mix: **{c['agreement']:.1%} vs "
              f"{mix['agreement']:.1%}** ({'met' if c['agreement'] > mix['agreement'] else 'not met'}).", "",
              "Router at every threshold (held-out half):", "", "| threshold | cost (s) | agreement | share to small | "
              "random mix at that cost |", "|---|---|---|---|---|"]
    for th, row in r["test"]["router"].items():
        eq = (row["cost_s"], row["agreement"])
        s, b = t["always_small"], t["always_big"]
        share = min(max((b["cost_s"] - eq[0]) / (b["cost_s"] - s["cost_s"]), 0.0), 1.0)
        lines.append(f"| {th} | {row['cost_s']:.3f} | {row['agreement']:.1%} | {row['small_share']:.0%} | "
                     f"{share * s['agreement'] + (1 - share) * b['agreement']:.1%} |")
    lines += ["", "What these numbers mean, and what they do not:", "",
              "- The mechanism works end to end: the classifier sees only features the gateway has before tokenizing, "
              "is trained on one half and judged on the other, and at the cost it chose it agrees with the big model "
              "more often than a random split of traffic with the same cost.",
              "- The two models are not a real small/big pair. Gemma-3-270M is a base model (its 4-bit GGUF, "
              "dequantized). Asked through a few-shot question/answer prompt, it often copies an example's answer "
              "(\"dog, cat, horse\", \"gracias\") or repeats a word of the question. Asked through its chat "
              "template, it echoes the prompt. So \"the small model agrees with the big one\" mostly measures word "
              "overlap with a weak model: fact questions count as easy because both answers contain the country's "
              "name. The agreement figures are not quality figures.",
              "- With an instruct pair (e.g. an 8B and a 70B model) the same script applies unchanged: label by "
              "agreement, train, choose a threshold on the training half, report the held-out curve. The easy "
              "kinds and the savings would be different.",
              "- Cost is each model's measured time per prompt and output token here, at batch 1 on a 2-core CPU. On "
              "GPUs at real batch sizes the small/big cost ratio differs, which moves the random-mix line. It does "
              "not move the router's advantage at equal cost.",
              "", "By kind (held-out): easy rate and the classifier's mean probability that the small model agrees:", "",
              "| kind | n | easy | mean p |", "|---|---|---|---|"]
    for kind, v in r["by_kind_test"].items():
        lines.append(f"| {kind} | {v['n']} | {v['easy_rate']:.0%} | {v['mean_p_small_agrees']:.2f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=["prompts", "label", "rates", "eval"])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--timing-prompts", type=int, default=12)
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--small-ref", default="smollm2", help="registry ref the written policy names for the small model")
    p.add_argument("--big-ref", default="gemma3", help="registry ref the written policy names for the big model")
    args = p.parse_args()
    if args.stage == "prompts":
        rows = make_prompts()
        PROMPTS.write_text("".join(json.dumps(r, sort_keys=True) + "\n" for r in rows))
        print(f"{len(rows)} prompts -> {PROMPTS}")
    elif args.stage == "label":
        label(args)
    elif args.stage == "rates":
        rates(args)
    else:
        evaluate(args)


if __name__ == "__main__":
    main()
