"""The built-in prompt set: instructions, code, prose, lists and dialogue, with no download.

Training prompts are task templates crossed with topics (36 x 173), code jobs crossed with languages,
and hand-written code and chat prompts: 6411 in all, varied, and many from few lines; the
held-out prompts are written separately, on topics that no training prompt names, so acceptance
measured on them is not measured on text the draft was trained to imitate.
"""

from __future__ import annotations

import itertools
import random
import re

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
