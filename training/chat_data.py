"""Chat-formatted training text for the small model, made from the corpus's facts.

Each conversation is rendered with the checkpoint's chat template (serving/assets/
chat_template.jinja, as the server renders prompts) and closed with `<|user|>`, so the model
learns where a reply ends. Kinds, all deterministic for a seed:
  function   "What does json.dumps do?"        -> the first paragraph of its documentation
  section    "Explain Joining zombie processes" -> the section's first paragraph
  fortune    "Tell me a fortune."               -> a fortune cookie
  tool       get_weather / search_docs / calculator calls in glm47's format, the tool's answer,
             then the reply that uses it
  arithmetic a sum or product worked out in a <think> trace
Most replies carry a short <think> trace (the template's default generation prompt opens one);
the rest open with </think>, as the template writes a reply without reasoning.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from pathlib import Path

from serving.front.chat import ChatTemplate
from serving.tools.tokenizer_build import CHAT_TEMPLATE_PATH

END_OF_TURN = "<|user|>"
THINK_SHARE = 0.7

SYSTEM_PROMPTS = (
    "You are a helpful assistant.",
    "You are a concise assistant that answers questions about Python, Git and Debian.",
    "Answer briefly and accurately.",
)
FUNCTION_QUESTIONS = (
    "What does {s} do?",
    "What is {s} for?",
    "Explain {s}.",
    "How do I use {s}?",
    "Can you describe {s}?",
    "Tell me about {s}.",
)
SECTION_QUESTIONS = (
    "Explain {s}.",
    "What should I know about {s}?",
    "Tell me about {s}.",
    "Can you explain {s} briefly?",
)
FORTUNE_QUESTIONS = (
    "Tell me a fortune.",
    "Say something wise.",
    "Give me a quote.",
    "Tell me something funny.",
)
CITIES = ("Paris", "Berlin", "Tokyo", "Lima", "Oslo", "Cairo", "Toronto", "Sydney", "Madrid",
          "Seoul", "Nairobi", "Lisbon", "Denver", "Hanoi", "Dublin", "Zurich")  # fmt: skip
CONDITIONS = ("sunny", "cloudy", "raining", "snowing", "windy", "foggy", "clear")

TOOLS = {
    "get_weather": {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "location": {"type": "string", "description": "The city name"},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["location"],
            },
        },
    },
    "search_docs": {
        "type": "function",
        "function": {
            "name": "search_docs",
            "description": "Search the Python documentation.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    },
    "calculator": {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    },
}


def _reply(rng: random.Random, answer: str, reasoning: str) -> dict:
    if rng.random() < THINK_SHARE:
        return {"role": "assistant", "content": answer, "reasoning_content": reasoning}
    return {"role": "assistant", "content": answer}


def _maybe_system(rng: random.Random) -> list[dict]:
    return [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.3 else []


def fact_chat(rng: random.Random, fact: dict) -> dict:
    subject = f"`{fact['subject']}`" if fact["kind"] == "function" else fact["signature"]
    questions = FUNCTION_QUESTIONS if fact["kind"] == "function" else SECTION_QUESTIONS
    question = rng.choice(questions).format(s=subject)
    if fact["kind"] == "function":
        answer = f"`{fact['signature']}`: {fact['text']}"
        module = fact["subject"].rsplit(".", 1)[0]
        reasoning = f"The user asks about {subject}, from `{module}`. I will give its signature "
        reasoning += "and say what it does."
    else:
        answer = fact["text"]
        reasoning = f"The user wants an explanation of {subject}. I will explain it in a paragraph."
    return {"messages": [*_maybe_system(rng), {"role": "user", "content": question},
                         _reply(rng, answer, reasoning)]}  # fmt: skip


def fortune_chat(rng: random.Random, cookie: str) -> dict:
    reasoning = "The user wants a fortune. I will share one."
    return {"messages": [{"role": "user", "content": rng.choice(FORTUNE_QUESTIONS)},
                         _reply(rng, cookie, reasoning)]}  # fmt: skip


def _call(name: str, **arguments: str) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def tool_chat(rng: random.Random, facts: list[dict]) -> dict:
    kind = rng.choice(("weather", "docs", "calc"))
    if kind == "weather":
        city, temp, cond = rng.choice(CITIES), rng.randint(-10, 35), rng.choice(CONDITIONS)
        question = rng.choice(("What is the weather in {c}?", "Is it cold in {c} today?",
                               "How is the weather in {c} right now?")).format(c=city)  # fmt: skip
        call = _call("get_weather", location=city)
        result = {"location": city, "temperature": temp, "unit": "celsius", "condition": cond}
        answer = f"It is {temp} degrees Celsius and {cond} in {city}."
        think = f"The user wants the current weather in {city}. I will call get_weather."
    elif kind == "docs":
        fact = rng.choice(facts)
        question = f"Look up {fact['subject']} in the Python documentation."
        call = _call("search_docs", query=fact["subject"])
        result = {"title": fact["signature"], "summary": fact["text"]}
        answer = f"According to the documentation, `{fact['signature']}`: {fact['text']}"
        think = f"I should search the documentation for {fact['subject']}."
    else:
        a, b = rng.randint(2, 999), rng.randint(2, 999)
        op, sym, value = rng.choice((("times", "*", a * b), ("plus", "+", a + b)))
        question = f"Use the calculator: what is {a} {op} {b}?"
        call = _call("calculator", expression=f"{a} {sym} {b}")
        result = {"result": value}
        answer = f"{a} {op} {b} is {value}."
        think = "The user asked me to use the calculator. I will call it with the expression."
    first = {"role": "assistant", "content": "", "tool_calls": [call]}
    if rng.random() < THINK_SHARE:
        first["reasoning_content"] = think
    return {
        "tools": list(TOOLS.values()),
        "messages": [
            {"role": "user", "content": question},
            first,
            {"role": "tool", "content": json.dumps(result)},
            {"role": "assistant", "content": answer},
        ],
    }


def arithmetic_chat(rng: random.Random) -> dict:
    a, b = rng.randint(10, 99), rng.randint(10, 99)
    tens, ones = (b // 10) * 10, b % 10
    if rng.random() < 0.5:
        question, value = f"What is {a} + {b}?", a + b
        steps = f"{a} + {tens} = {a + tens}. {a + tens} + {ones} = {value}."
    else:
        question, value = f"What is {a} times {b}?", a * b
        steps = f"{a} * {tens} = {a * tens}. {a} * {ones} = {a * ones}. "
        steps += f"{a * tens} + {a * ones} = {value}."
    reply = {"role": "assistant", "content": f"The answer is {value}.", "reasoning_content": steps}
    return {"messages": [{"role": "user", "content": question}, reply]}


def conversations(facts: list[dict], cookies: list[str], seed: int = 0) -> Iterator[dict]:
    rng = random.Random(seed)
    dotted = [f for f in facts if f["kind"] == "section" or "." in f["subject"]]
    for fact in dotted:
        yield fact_chat(rng, fact)
    for cookie in cookies:
        yield fortune_chat(rng, cookie)
    for _ in range(len(dotted) // 4):
        yield tool_chat(rng, dotted)
    for _ in range(len(dotted) // 8):
        yield arithmetic_chat(rng)


def render(template: ChatTemplate, conversation: dict) -> str:
    text = template.render(conversation["messages"], conversation.get("tools"), False)
    return text + END_OF_TURN


def chat_texts(facts_path: Path, cookies: list[str], seed: int = 0) -> list[str]:
    import gzip

    with gzip.open(facts_path, "rt", encoding="utf-8") as f:
        facts = [json.loads(line) for line in f]
    template = ChatTemplate(CHAT_TEMPLATE_PATH.read_text(encoding="utf-8"))
    texts = [render(template, c) for c in conversations(facts, cookies, seed)]
    random.Random(seed).shuffle(texts)
    return texts
