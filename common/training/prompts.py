"""The built-in prompt set: instructions, code, prose, lists and dialogue, with no download.

Training prompts are task templates crossed with topics (36 x 173), code jobs crossed with languages,
and hand-written code and chat prompts: 6411 in all, varied, and many from few lines; the
held-out prompts are written separately, on topics that no training prompt names, so acceptance
measured on them is not measured on text the draft was trained to imitate. A coding set (PROMPT_SETS
["coding"]: code jobs, programming topics, and 71 held-out coding prompts) serves a coding target.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import random
import re
from collections.abc import Callable

TOPICS = [
    # science and nature
    "photosynthesis",
    "the water cycle",
    "black holes",
    "volcanoes",
    "the immune system",
    "climate change",
    "earthquakes",
    "vaccines",
    "the human heart",
    "rainforests",
    "glaciers",
    "gravity",
    "octopuses",
    "honeybees",
    "coral reefs",
    "the periodic table",
    "magnets",
    "tides",
    "deserts",
    "sharks",
    "owls",
    "mushrooms",
    "the human brain",
    "bones",
    "antibiotics",
    "electricity",
    "static electricity",
    "sound waves",
    "atoms",
    "evolution",
    "dinosaurs",
    "whales",
    "penguins",
    "elephants",
    "ants",
    "wolves",
    "tornadoes",
    "hurricanes",
    "fossils",
    "the Milky Way",
    "comets",
    "the speed of light",
    "friction",
    "lightning",
    "caves",
    "rivers",
    "mountains",
    "the ocean floor",
    "bacteria",
    "viruses",
    "the digestive system",
    "lungs",
    "nutrition",
    "vitamins",
    "seeds",
    "trees",
    "bamboo",
    "soil",
    "wind",
    "snowflakes",
    "thunder",
    # history and society
    "the French Revolution",
    "the Roman Empire",
    "ancient Egypt",
    "the printing press",
    "the Silk Road",
    "democracy",
    "the moon landing",
    "the Industrial Revolution",
    "the Vikings",
    "the Great Wall of China",
    "the Renaissance",
    "the Aztecs",
    "medieval castles",
    "the Cold War",
    "the invention of the telephone",
    "the steam engine",
    "ancient Greece",
    "the samurai",
    "the Maya civilization",
    "the history of money",
    "the United Nations",
    "elections",
    "taxes",
    "human rights",
    "the history of writing",
    "lighthouses",
    "pirates",
    # technology
    "machine learning",
    "the internet",
    "electric cars",
    "solar panels",
    "smartphones",
    "computer viruses",
    "cloud computing",
    "batteries",
    "robots",
    "3D printing",
    "GPS",
    "video games",
    "social media",
    "passwords",
    "email",
    "search engines",
    "wind turbines",
    "nuclear power",
    "satellites",
    "the microscope",
    "cameras",
    "open source software",
    "databases",
    "spreadsheets",
    "quantum computers",
    "self-driving cars",
    "drones",
    # everyday life and culture
    "coffee",
    "tea",
    "chess",
    "jazz music",
    "the stock market",
    "sleep",
    "bread baking",
    "friendship",
    "public libraries",
    "marathon training",
    "recycling",
    "gardening",
    "yoga",
    "meditation",
    "camping",
    "photography",
    "painting",
    "learning the guitar",
    "budgeting",
    "saving money",
    "time management",
    "moving to a new city",
    "job interviews",
    "volunteering",
    "board games",
    "chocolate",
    "pizza",
    "rice",
    "cheese",
    "spices",
    "museums",
    "theater",
    "opera",
    "ballet",
    "poetry",
    "comic books",
    "birthdays",
    "holidays",
    "trains",
    "road trips",
    "hiking",
    "swimming",
    "soccer",
    "basketball",
    "chess openings",
    "origami",
    "knitting",
    "pottery",
    "houseplants",
    "bird watching",
    "fishing",
    "cooking pasta",
    "first aid",
    "fire safety",
    "city parks",
    "architecture",
    "bridges",
    "skyscrapers",
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
    "Walk me through the basics of {t}.",
    "Why is {t} important?",
    "Write a rhyming poem about {t}.",
    "Write a tweet about {t}.",
    "Write a short blog post introduction about {t}.",
    "Give me five quiz questions about {t}, with answers.",
    "Explain {t} using an analogy.",
    "Write a persuasive paragraph about why people should care about {t}.",
    "What would a beginner need to know about {t}?",
    "Write an outline for an essay on {t}.",
    "Give me a fun fact about {t} and explain why it is true.",
    "Write a short news report about {t}.",
    "What are some common questions people ask about {t}? Answer two of them.",
    "Write a product description for a book about {t}.",
    "Compare {t} today with {t} fifty years ago.",
    "Write a letter to a friend telling them about {t}.",
    "Explain {t} in exactly three bullet points.",
    "What careers are related to {t}?",
    "Tell me a short joke about {t}.",
    "Write the opening of a speech about {t}.",
    "Define {t} in one sentence, then expand on it.",
    "Write a markdown table with three facts about {t}.",
    "What are three surprising things about {t}?",
    "Give me tips for teaching children about {t}.",
]

CODE_LANGUAGES = ["Python", "JavaScript", "C", "Go", "Rust", "Java"]

CODE_JOBS = [
    "reverses a string",
    "checks whether a number is prime",
    "returns the n-th Fibonacci number",
    "sums an array of numbers",
    "counts the words in a sentence",
    "computes the factorial of n",
    "computes the greatest common divisor of two numbers",
    "checks whether a year is a leap year",
    "finds the largest number in a list",
    "performs a binary search on a sorted array",
    "counts the vowels in a string",
    "converts Celsius to Fahrenheit",
    "removes duplicate items from a list",
    "transposes a matrix",
    "capitalizes the first letter of each word",
    "computes the mean of a list of numbers",
    "implements a stack with push and pop",
    "sorts a list with bubble sort",
    "flattens a nested list",
    "returns the second largest element of a list",
]

CODE_TASKS = [
    "Write a SQL query that selects all users older than 30.",
    "Write a SQL query that finds the five most expensive products.",
    "Write a SQL query that joins an employees table with a departments table.",
    "Write a SQL statement that creates a table for books with a title, author and year.",
    "Explain what a Python list comprehension is, with an example.",
    "Write a Python class for a simple bank account with deposit and withdraw.",
    "Write a bash command that counts the lines in all .txt files.",
    "What is the difference between a list and a tuple in Python?",
    "Write a Python function that sorts a list of dictionaries by a key.",
    "Explain recursion with a short code example.",
    "Write a Python script that reads a CSV file and prints each row.",
    "How do I remove duplicates from a list in Python?",
    "Write a regular expression that matches an email address.",
    "Explain what a hash map is and when to use one.",
    "What does the git rebase command do?",
    "Explain the difference between an interface and a class.",
    "Write a Python decorator that times a function.",
    "How do I read a JSON file in Python?",
    "Explain big O notation with examples.",
    "Write a unit test in Python for a function that adds two numbers.",
    "What is the difference between a process and a thread?",
    "Write an HTML page with a heading and a button.",
    "Write CSS that centers a div on the page.",
    "Explain what an API is to a beginner.",
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
    "What is the capital of Canada?",
    "How many days are there in a leap year?",
    "What is 144 divided by 12?",
    "Write a birthday message for my grandmother.",
    "Suggest a name for a small bakery.",
    "How do I make a cup of green tea?",
    "What should I pack for a beach holiday?",
    "How can I sleep better at night?",
    "Give me three ideas for a rainy afternoon.",
    "How do I apologize to a friend I upset?",
    "What is the tallest mountain in the world?",
    "Write a short invitation to a housewarming party.",
    "How do I keep my houseplants alive?",
    "What are good questions to ask at the end of a job interview?",
    "Recommend three classic movies and say why.",
    "Help me write a to-do list for moving house.",
    "What is the difference between a virus and a bacterium?",
    "How long should I boil an egg?",
    "Write a short review of a fictional coffee shop.",
    "What are the primary colors?",
    "How do I calculate a 15 percent tip?",
    "Explain what a mortgage is.",
    "What is the boiling point of water in Fahrenheit?",
]

# Held out: none of these prompts, and none of their topics, appears above (their forms do: explain,
# poem, recipe, list, as in any instruction data). HELD_OUT_SUBJECTS names the topics (tests check them).
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
    """All training prompts (topics x tasks, languages x code jobs, then code and chat), in a seeded
    order: --num-prompts N takes a varied N of them."""
    prompts = [task.format(t=topic) for task, topic in itertools.product(TASKS, TOPICS)]
    prompts += [
        f"Write a {lang} function that {job}." for lang, job in itertools.product(CODE_LANGUAGES, CODE_JOBS)
    ]
    prompts += CODE_TASKS + CHAT_TASKS
    random.Random(seed).shuffle(prompts)
    return prompts


def held_out_prompts() -> list[str]:
    return list(HELD_OUT)


# The subject of each held-out prompt, as words no training prompt may contain (whole words, any case):
# the built-in training prompts never do (tests/test_train_draft.py), and prompts the target writes
# itself (common/training/self_instruct.py) that do are dropped.
HELD_OUT_SUBJECTS = {
    "refrigerator": "refrigerators?", "autumn leaves": "autumn|leaves", "resume": "resumes?",
    "sorted lists": "merges?|merging", "weather": "weather", "butterfly": "butterfl(y|ies)",
    "restaurant": "restaurants?|waiters?", "planets": "planets?|solar system", "bicycle": "bicycles?|bikes?",
    "palindrome": "palindromes?", "inflation": "inflation", "Olympics": "olympics?", "dog": "dogs?",
    "public speaking": "public speaking", "DNA": "dna", "orders per customer": "orders",
    "exercise": "exercises?", "sky": "sky", "tomato soup": "tomato(es)?|soups?", "tennis": "tennis",
    "Pythagoras": "pythagore(an|as)", "limerick": "limericks?", "cat": "cats?",
    "airplanes": "airplanes?|aeroplanes?", "Romeo and Juliet": "romeo|juliet",
}  # fmt: skip
_HELD_OUT_SUBJECT = re.compile(rf"\b({'|'.join(HELD_OUT_SUBJECTS.values())})\b", re.IGNORECASE)


def names_held_out_subject(text: str) -> bool:
    return _HELD_OUT_SUBJECT.search(text) is not None


# Topics in no training prompt and no held-out one: the training templates on these measure how the
# draft does on new subjects in familiar forms, between the training prompts and the held-out chat
# (bench/bench_draft.py --prompt-set unseen-topics).
UNSEEN_TOPICS = [
    "submarines", "solar eclipses", "beekeeping", "hot air balloons", "glassblowing", "tectonic plates",
    "sourdough", "the violin", "fire ants", "sign language", "the Roman aqueducts", "compost", "the abacus",
    "radar", "kites", "the Sahara", "the telegraph", "carnivorous plants", "hedgehogs", "the metric system",
    "the Eiffel Tower", "geysers", "the harmonica", "crossword puzzles",
]  # fmt: skip


def unseen_topic_prompts(seed: int = 1) -> list[str]:
    """One training template (seeded choice) per unseen topic."""
    rng = random.Random(seed)
    return [rng.choice(TASKS).format(t=topic) for topic in UNSEEN_TOPICS]


# Self-instruct: the target writes user prompts itself, as numbered lists (a 135M model's single
# questions at T = 1 were mostly noise; its numbered lists at T = 0.7 are mostly clean questions).
# Each form is used with a topic where it has {t}, else as it is.
SELF_INSTRUCT_FORMS = [
    "Write a numbered list of five different questions that people often ask about {t}.",
    "Write a numbered list of five requests that people might send to an AI assistant about {t}.",
    "Write a numbered list of five questions a student might ask a teacher about {t}.",
    "Write a numbered list of five short questions about how {t} works or why it matters.",
    "Write a numbered list of five things people ask an assistant to write for them, such as emails, "
    "poems, stories, recipes or plans.",
    "Write a numbered list of five questions people ask an assistant for advice in everyday life.",
    "Write a numbered list of five questions about how everyday things work.",
    "Write a numbered list of five programming questions that beginners often ask.",
]


# ------------------------------------------------------------------------------------------- coding set
# A coding target's prompts (`--prompt-set coding`): code jobs in several languages, programming topics
# in task templates, the code and chat-about-code prompts above; held out, coding prompts on subjects no
# coding training prompt names (HELD_OUT_CODING_SUBJECTS, checked by tests/test_prompts.py).
CODING_LANGUAGES = ["Python", "JavaScript", "TypeScript", "C", "C++", "Go", "Rust", "Java"]

CODING_JOBS = [
    *CODE_JOBS,
    "counts how often each character appears in a string",
    "checks whether two strings are equal ignoring case",
    "returns the last n items of a list",
    "splits a list into chunks of size n",
    "computes the power of a number",
    "converts a binary string to an integer",
    "checks whether a list is sorted",
    "reads a text file and counts its lines",
    "returns the index of an item in a list",
    "zips two lists into pairs",
    "computes the median of a list",
    "validates that a string contains only digits",
    "joins a list of strings with commas",
    "finds the common elements of two lists",
    "generates all subsets of a set",
    "computes the dot product of two vectors",
    "converts a number to its binary representation",
    "pads a string to a given width",
    "truncates a string to n characters",
    "swaps two variables",
    "clamps a number to a range",
    "computes the distance between two points",
    "checks whether a string starts with a prefix",
    "counts the occurrences of a value in a list",
    "returns the minimum and maximum of a list",
    "filters the even numbers from a list",
    "parses a date string",
    "generates a random password",
    "implements a queue with two stacks",
    "checks whether a number is a perfect square",
]

CODING_TOPICS = [
    "linked lists", "hash tables", "binary trees", "stacks", "recursion", "closures", "pointers",
    "string formatting", "exceptions", "unit testing", "file input and output", "regular expressions",
    "sorting algorithms", "dynamic arrays", "classes and objects", "inheritance", "interfaces", "generics",
    "lambda functions", "higher-order functions", "immutability", "type annotations", "modules and imports",
    "package managers", "virtual environments", "command-line arguments", "environment variables",
    "logging", "debugging", "code reviews", "version control", "branching in git", "pull requests",
    "continuous integration", "REST APIs", "HTTP status codes", "JSON parsing", "YAML configuration",
    "SQL joins", "database transactions", "ORMs", "threads", "processes", "event loops", "callbacks",
    "promises", "garbage collection", "memory leaks", "integer overflow", "floating point numbers",
    "bitwise operators", "string encoding", "date parsing", "random number generation", "graphs",
    "breadth-first search", "depth-first search", "binary search", "big O notation", "design patterns",
    "the singleton pattern", "dependency injection", "caching", "profiling", "code documentation",
    "HTML forms", "CSS flexbox", "the DOM", "web servers", "shell scripting", "Docker containers", "linting",
]  # fmt: skip

CODING_TASKS = [
    "Explain {t} in {lang} with a short example.",
    "Write a short {lang} example that demonstrates {t}.",
    "What are common mistakes with {t} in {lang}?",
    "How do I use {t} in {lang}? Show code.",
    "Write a beginner's tutorial on {t} in {lang}.",
    "What are best practices for {t} in {lang}?",
    "Give me a {lang} exercise about {t}, with its solution.",
    "Explain {t} to a junior developer.",
    "Write a code review checklist for {t}.",
    "Show a bug related to {t} in {lang} and how to fix it.",
    "When should I avoid {t}? Give a {lang} example.",
    "Summarize {t} in three bullet points.",
    "Write three interview questions about {t}, with answers.",
    "Write {lang} documentation comments for a function that uses {t}.",
    "Write a {lang} unit test that checks code using {t}.",
]

HELD_OUT_CODING = [
    "Write a Python class that implements a trie with insert and prefix search.",
    "Implement Dijkstra's shortest path algorithm in Python using heapq.",
    "Write an LRU cache class in Python without using functools.",
    "Write a token bucket rate limiter in Go.",
    "Implement a Bloom filter in Python and explain its false positive rate.",
    "Write a function that performs a topological sort of a directed acyclic graph.",
    "Solve the 0/1 knapsack problem with dynamic programming in Python.",
    "Write a function that computes the Levenshtein distance between two strings.",
    "Implement run-length encoding and decoding in JavaScript.",
    "Write a function that converts an integer to Roman numerals.",
    "Write a sudoku solver in Python using backtracking.",
    "Solve the N-queens problem in C++.",
    "Write a function that returns the elements of a matrix in spiral order.",
    "Given a list of intervals, merge the overlapping ones. Write it in Java.",
    "Write a debounce function in JavaScript and explain when to use it.",
    "Explain how a mutex differs from a semaphore, with a C example.",
    "Write a producer and consumer example in Python with threading.",
    "Write a minimal WebSocket echo server in Node.js.",
    "Explain how JSON Web Tokens work and write Python code that verifies one.",
    "Write a URL shortener service in Flask with an in-memory store.",
    "Write a tic-tac-toe game for the terminal in Python.",
    "Implement Conway's Game of Life in JavaScript on a canvas.",
    "Write the sieve of Eratosthenes in Rust.",
    "Implement base64 encoding from scratch in C.",
    "Write a function that computes a CRC32 checksum.",
    "Implement a Fenwick tree with point updates and prefix sums.",
    "Write a segment tree for range minimum queries in C++.",
    "Implement union-find with path compression in Python.",
    "Implement quickselect to find the k-th smallest element of an array.",
    "Write reservoir sampling for a stream of unknown length.",
    "Write a function that counts the set bits of an integer.",
    "Write a function that groups words that are anagrams of each other.",
    "Find the maximum subarray sum with Kadane's algorithm.",
    "Solve the two-sum problem in O(n) time in Go.",
    "Write a function that checks whether the brackets in a string are balanced.",
    "Detect a loop in a linked list with Floyd's algorithm.",
    "Implement a min-heap in Java with insert and extract-min.",
    "Implement k-means clustering with NumPy.",
    "Write a function that multiplies two matrices without any library.",
    "Write FizzBuzz in Rust.",
    "Serialize and deserialize a binary tree in Python.",
    "Rotate an N x N image by 90 degrees in place.",
    "Write a Python script that prints the ten most frequent words in a text file.",
    "Write a retry decorator with exponential backoff in Python.",
    "Write a Dockerfile for a small Flask application.",
    "Write a Makefile that builds a C project with separate object files.",
    "Write a GraphQL schema for a blog with posts and comments.",
    "Explain the five fields of a cron expression with examples.",
    "Write a Python generator that yields Fibonacci numbers forever.",
    "Write a Python context manager that measures elapsed time.",
    "Convert this class to a Python dataclass:\n\nclass Point:\n    def __init__(self, x, y):\n"
    "        self.x = x\n        self.y = y",
    "Implement pagination for a REST endpoint that lists products.",
    "Write a SQL query that ranks employees by salary within each department using a window function.",
    "Explain what git bisect does and show an example session.",
    "Write a function that compares two semantic version strings.",
    "Explain Unicode normalization forms with Python examples.",
    "Write Python code that converts a UTC timestamp to a given time zone.",
    "Write a stopwatch class in C# with start, stop and reset.",
    "Write a calculator that evaluates arithmetic expressions with parentheses.",
    "What does this code print, and why?\n\nx = [1, 2, 3]\ny = x\ny.append(4)\nprint(x)",
    "Find the bug in this function:\n\ndef avg(xs):\n    return sum(xs) / len(xs) - 1",
    "Write a binary search tree deletion function in C.",
    "Write a bash script that backs up a directory into a dated tar archive.",
    "Write a TypeScript type guard for a discriminated union.",
    "Implement a thread pool in C++ with std::thread.",
    "Explain the CAP theorem and give an example system for each trade-off.",
    "Write a function that flattens a nested dictionary into dotted keys.",
    "Implement the observer pattern in Java.",
    "Write a function that returns all permutations of a string.",
    "Compute the longest common subsequence of two strings in Python.",
    "Implement a circular buffer in C.",
]

# The subject of each held-out coding prompt, as words no coding training prompt contains (whole words,
# any case); coding prompts the target writes itself that name one are dropped.
HELD_OUT_CODING_SUBJECTS = {
    "trie": "tries?", "Dijkstra": "dijkstra", "LRU cache": "lru", "rate limiter": "rate limit\\w*",
    "Bloom filter": "bloom", "topological sort": "topological", "knapsack": "knapsack",
    "Levenshtein": "levenshtein", "run-length encoding": "run-length", "Roman numerals": "numerals?",
    "sudoku": "sudoku|backtracking", "N-queens": "queens?", "spiral order": "spiral",
    "intervals": "intervals?", "debounce": "debounc\\w*", "mutex": "mutex(es)?|semaphores?",
    "producer and consumer": "producers?|consumers?", "WebSocket": "websockets?",
    "JSON Web Tokens": "json web tokens?|jwts?", "URL shortener": "shorteners?",
    "tic-tac-toe": "tic-tac-toe", "Game of Life": "conway|game of life",
    "sieve": "sieve|eratosthenes", "base64": "base64", "CRC32": "crc32|checksums?", "Fenwick": "fenwick",
    "segment tree": "segment trees?", "union-find": "union-find|path compression",
    "quickselect": "quickselect", "reservoir sampling": "reservoir", "set bits": "set bits|popcount",
    "anagrams": "anagrams?", "Kadane": "kadane|subarrays?", "two-sum": "two-sum",
    "brackets": "brackets?|balanced", "Floyd": "floyd", "min-heap": "min-heap|heaps?",
    "k-means": "k-means|clustering", "matrix product": "multipl(y|ies|ication)", "FizzBuzz": "fizzbuzz",
    "serialization": "serializ\\w*|deserializ\\w*", "image rotation": "images?|degrees",
    "frequent words": "frequent", "backoff": "backoff", "Dockerfile": "dockerfiles?|flask",
    "Makefile": "makefiles?", "GraphQL": "graphql", "cron": "cron", "generators": "generators?|yields?",
    "context manager": "context managers?", "dataclass": "dataclass(es)?", "pagination": "paginat\\w*",
    "window function": "window functions?|salar(y|ies)", "git bisect": "bisect",
    "semantic versions": "semantic version\\w*|semver", "Unicode normalization": "unicode|normali[sz]\\w*",
    "time zones": "time ?zones?|utc", "stopwatch": "stopwatch(es)?",
    "calculator": "calculators?|arithmetic|parenthes[ie]s", "aliasing": "append",
    "average bug": "avg", "tree deletion": "deletion", "backups": "backs up|backups?|tar archives?",
    "type guard": "type guards?|discriminated", "thread pool": "thread pools?", "CAP theorem": "cap theorem",
    "dotted keys": "dotted", "observer": "observers?", "permutations": "permutations?",
    "longest common subsequence": "subsequences?", "circular buffer": "circular|ring buffers?",
}  # fmt: skip


def coding_training_prompts(seed: int = 0) -> list[str]:
    """The coding set's training prompts (code jobs x languages, each (task, topic) once in a language
    drawn with a fixed seed, and the code prompts), in a seeded order."""
    lang = random.Random(0)
    prompts = [
        f"Write a {name} function that {job}."
        for name, job in itertools.product(CODING_LANGUAGES, CODING_JOBS)
    ]
    prompts += [
        task.format(t=topic, lang=lang.choice(CODING_LANGUAGES))
        for task, topic in itertools.product(CODING_TASKS, CODING_TOPICS)
    ]
    prompts += CODE_TASKS
    random.Random(seed).shuffle(prompts)
    return prompts


# Self-instruct for a coding target: numbered lists of programming questions and requests.
CODING_SELF_INSTRUCT_FORMS = [
    "Write a numbered list of five different programming questions that people often ask about {t}.",
    "Write a numbered list of five coding tasks that a developer might ask an AI assistant to do with {t}.",
    "Write a numbered list of five questions a student might ask a teacher about {t} in programming.",
    "Write a numbered list of five short requests for code that uses {t}.",
    "Write a numbered list of five programming questions that beginners often ask.",
    "Write a numbered list of five requests to write a small function, each naming a programming language.",
    "Write a numbered list of five questions developers ask about errors in their code.",
]


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Training prompts, held-out prompts (never trained on), the held-out subjects (words no training
    prompt and no kept self-instructed prompt may contain) and the self-instruct forms and topics."""

    training: Callable[[int], list[str]]
    held_out: Callable[[], list[str]]
    subjects: dict[str, str]
    self_instruct_forms: list[str]
    self_instruct_topics: list[str]

    def names_held_out_subject(self, text: str) -> bool:
        return _subject_pattern(tuple(self.subjects.values())).search(text) is not None


@functools.cache
def _subject_pattern(words: tuple[str, ...]) -> re.Pattern[str]:
    return re.compile(rf"\b({'|'.join(words)})\b", re.IGNORECASE)


PROMPT_SETS = {
    "general": PromptSet(training_prompts, held_out_prompts, HELD_OUT_SUBJECTS, SELF_INSTRUCT_FORMS, TOPICS),
    "coding": PromptSet(
        coding_training_prompts,
        lambda: list(HELD_OUT_CODING),
        HELD_OUT_CODING_SUBJECTS,
        CODING_SELF_INSTRUCT_FORMS,
        CODING_TOPICS,
    ),
}
