"""The built-in prompt set: instructions, code, prose, lists and dialogue, with no download.

Training prompts are task templates crossed with topics (varied, and many from few lines); the
held-out prompts are written separately, on topics that no training prompt names, so acceptance
measured on them is not measured on text the draft was trained to imitate.
"""

from __future__ import annotations

import itertools
import random

TOPICS = [
    "photosynthesis",
    "the water cycle",
    "black holes",
    "the French Revolution",
    "volcanoes",
    "machine learning",
    "the immune system",
    "climate change",
    "the Roman Empire",
    "electric cars",
    "coffee",
    "honeybees",
    "the internet",
    "chess",
    "the moon landing",
    "earthquakes",
    "vaccines",
    "democracy",
    "solar panels",
    "the human heart",
    "ancient Egypt",
    "recycling",
    "jazz music",
    "the stock market",
    "rainforests",
    "sleep",
    "the printing press",
    "glaciers",
    "bread baking",
    "gravity",
    "friendship",
    "public libraries",
    "marathon training",
    "the Silk Road",
    "octopuses",
]

TASKS = [
    "Explain {t} to a ten-year-old.",
    "Write a short paragraph about {t}.",
    "Give me three interesting facts about {t}.",
    "List five key words related to {t}, one per line.",
    "What are the pros and cons of {t}?",
    "Write a haiku about {t}.",
    "Summarize the history of {t} in two sentences.",
    "Write a short story that involves {t}.",
    "What is the most common misconception about {t}?",
    "Write a dialogue between a teacher and a student about {t}.",
    "Describe {t} in simple terms.",
    "Write a numbered list of steps to learn about {t}.",
]

CODE_TASKS = [
    "Write a Python function that reverses a string.",
    "Write a Python function to check whether a number is prime.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "Write a SQL query that selects all users older than 30.",
    "Write a JavaScript function that sums an array of numbers.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a Python class for a simple bank account with deposit and withdraw.",
    "Write a bash command that counts the lines in all .txt files.",
    "Write a Python function that counts the words in a sentence.",
    "What is the difference between a list and a tuple in Python?",
    "Write a Python function that sorts a list of dictionaries by a key.",
    "Write a C function that computes the factorial of n.",
    "Explain recursion with a short code example.",
    "Write a Python script that reads a CSV file and prints each row.",
    "How do I remove duplicates from a list in Python?",
    "Write a regular expression that matches an email address.",
]

CHAT_TASKS = [
    "Hi! How are you today?",
    "Can you recommend a good book for a long flight?",
    "I feel tired all the time. Any tips?",
    "What should I cook for dinner tonight?",
    "Tell me a joke.",
    "How do I politely decline an invitation?",
    "What is a good way to start learning a new language?",
    "Can you help me plan a weekend trip?",
    "What is the capital of Australia?",
    "How many legs does a spider have?",
    "Write a thank-you note to a colleague.",
    "Give me a motivational quote and explain it.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish, French and German.",
    "Write an email asking my manager for a day off.",
    "What are some healthy breakfast ideas?",
]

# Held out: none of these topics or tasks appears above.
HELD_OUT = [
    "Explain how a refrigerator keeps food cold.",
    "Write a short poem about autumn leaves.",
    "Give me four tips for writing a good resume.",
    "Write a Python function that merges two sorted lists.",
    "What is the difference between weather and climate?",
    "Describe the life cycle of a butterfly.",
    "Write a dialogue between a customer and a waiter in a restaurant.",
    "List the planets of the solar system in order.",
    "How does a bicycle stay upright?",
    "Write a JavaScript function that checks whether a string is a palindrome.",
    "What are the main causes of inflation?",
    "Tell me about the history of the Olympic Games.",
    "Write a short story about a lost dog finding its way home.",
    "How can I improve my public speaking?",
    "Explain what DNA is in simple terms.",
    "Write a SQL query that counts orders per customer.",
    "What are three benefits of regular exercise?",
    "Why is the sky blue?",
    "Write a recipe for a simple tomato soup.",
    "Explain the rules of tennis briefly.",
    "What is the Pythagorean theorem? Give an example.",
    "Write a limerick about a cat.",
    "How do airplanes fly?",
    "Summarize the plot of Romeo and Juliet.",
]


def training_prompts(seed: int = 0) -> list[str]:
    """All training prompts (topics x tasks, then code and chat), in a seeded order."""
    prompts = [task.format(t=topic) for task, topic in itertools.product(TASKS, TOPICS)]
    prompts += CODE_TASKS + CHAT_TASKS
    random.Random(seed).shuffle(prompts)
    return prompts


def held_out_prompts() -> list[str]:
    return list(HELD_OUT)
