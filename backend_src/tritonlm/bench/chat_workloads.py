"""Chat workloads of real text for speculative decoding: `grounded` asks to edit or restate a
given text or code (answers copy from the prompt, where prompt lookup finds its proposals);
`chat` asks open questions (answers copy little)."""
from tritonlm.bench.workloads import BenchRequest

_REPORT = (
    "The storage cluster lost two of its five nodes on Tuesday night after a firmware update "
    "rebooted them at the same time. Replication kept every volume readable, but writes to the "
    "volumes whose replicas both lived on the rebooted nodes failed for forty minutes. The "
    "on-call engineer paused the rollout, brought the nodes back one at a time and watched the "
    "rebalancing finish before resuming. No data was lost. Next quarter the team will stagger "
    "firmware updates across failure domains and alert when two replicas share a rack.")
_RECIPE = (
    "Heat the oven to 200 degrees. Cut the potatoes into thin slices and toss them with olive "
    "oil, salt and rosemary. Spread them on a tray in one layer and bake for twenty-five "
    "minutes, turning them once halfway. Meanwhile whisk the yoghurt with lemon juice, garlic "
    "and a pinch of pepper. Serve the potatoes hot with the sauce on the side.")
_CODE = '''def load_users(path):
    users = []
    with open(path) as f:
        for line in f:
            name, age, city = line.strip().split(",")
            users.append({"name": name, "age": int(age), "city": city})
    return users


def adults(users):
    return [u for u in users if u["age"] >= 18]


def count_by_city(users):
    counts = {}
    for u in users:
        counts[u["city"]] = counts.get(u["city"], 0) + 1
    return counts
'''
_CLASS = '''class Counter:
    def __init__(self):
        self.total = 0
        self.seen = 0

    def add(self, value):
        self.total += value
        self.seen += 1

    def mean(self):
        return self.total / self.seen
'''

GROUNDED = [
    f"Fix the grammar and spelling of this text and return the corrected text:\n\n"
    f"{_REPORT.replace('their', 'thier').replace('lost', 'loosed')}",
    f"Add type hints to every function in this code:\n\n{_CODE}",
    f"Rewrite this recipe as a numbered list of steps:\n\n{_RECIPE}",
    f"Add a docstring to each method of this class:\n\n{_CLASS}",
    f"Rename the variable `users` to `people` in this code:\n\n{_CODE}",
    f"Summarise this incident report in three sentences:\n\n{_REPORT}",
    f"Quote the sentences of this text that mention time:\n\n{_REPORT}",
    f"Rewrite this class with a `reset` method added:\n\n{_CLASS}",
]
CHAT = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are the main differences between a cat and a dog as a pet?",
    "Explain how a rainbow forms, for a ten-year-old.",
    "Give me five ideas for a rainy Sunday afternoon.",
    "Why do leaves change colour in autumn?",
    "Describe your ideal weekend trip to the mountains.",
    "What should I consider when choosing my first programming language?",
    "Write a friendly email inviting my neighbours to a garden party.",
]


def chat_requests(kind: str, tokenizer, num: int, output_len: int) -> list[BenchRequest]:
    """`num` requests cycling through the `kind` ("grounded" or "chat") tasks, each as a chat
    prompt in the model's template."""
    tasks = GROUNDED if kind == "grounded" else CHAT
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": task}],
                                             add_generation_prompt=True, return_dict=False)
               for task in tasks]
    return [BenchRequest(list(prompts[i % len(prompts)]), output_len) for i in range(num)]
