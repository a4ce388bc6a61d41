"""A copy workload for prompt-lookup drafting (issue 28 item 2): tasks whose answer mostly repeats the prompt.

Each task asks the model to rewrite a passage with one word changed, to fix one line of a code block, or to quote
a retrieved passage while answering: the answer copies long runs of the prompt, where a prompt-lookup drafter
should win. The texts were written for this project (no third-party data; same license as the project).
"""

from __future__ import annotations

PASSAGES = [
    ("The old lighthouse stood at the edge of the cliff for more than a hundred years. Every night the keeper "
     "climbed the narrow stairs, trimmed the wick and polished the great lens until it shone. Ships passing in the "
     "dark trusted its steady beam to guide them safely around the rocks below.", "keeper", "guardian"),
    ("Our team meets every Monday morning to review the previous week. Each person shares what they finished, "
     "what is blocked and what they plan to do next. The meeting lasts thirty minutes and ends with a short list "
     "of actions that someone owns by name.", "Monday", "Tuesday"),
    ("To make bread, mix flour, water, salt and yeast in a large bowl. Knead the dough for ten minutes until it is "
     "smooth, then let it rise in a warm place for two hours. Shape the loaf, bake it in a hot oven for forty "
     "minutes and let it cool before slicing.", "two", "three"),
    ("The river begins as a small spring high in the mountains. It gathers water from melting snow and many small "
     "streams as it flows down through the forest. By the time it reaches the valley it is wide and slow, and "
     "farmers use it to water their fields.", "forest", "woods"),
]

CODE = '''def total_price(items, tax_rate):
    """Return the total price of the items including tax."""
    subtotal = 0
    for item in items:
        subtotal += item["price"] * item["quantity"]
    tax = subtotal * tax_rate
    return subtotal + tax
'''


def copy_chats() -> list[list[dict]]:
    """Single-turn chats whose answers copy the prompt (passage rewrites first, then a code edit)."""
    chats = [[{"role": "user", "content": f"Rewrite the following passage exactly as it is, but replace the word "
                                           f"\"{old}\" with \"{new}\". Output only the rewritten passage.\n\n{text}"}]
             for text, old, new in PASSAGES]
    chats.append([{"role": "user", "content": "Rewrite this function exactly, but rename the variable subtotal to "
                                               "base. Output only the code.\n\n" + CODE}])
    return chats
