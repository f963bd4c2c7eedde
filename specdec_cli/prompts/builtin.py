"""The built-in prompt set of `specdec compare`: two prompts in each of six categories, written for
this project. Short on purpose: a benchmark that takes minutes per configuration does not get run."""

BUILTIN_PROMPTS: tuple[tuple[str, str], ...] = (
    ("chat", "I have a job interview for a junior data analyst role on Monday. What should I prepare, "
             "and what questions should I ask the interviewer?"),
    ("chat", "My sourdough bread keeps coming out dense and flat. What are the most likely causes and "
             "how do I fix each one?"),
    ("code", "Write a Python function `merge_intervals(intervals)` that merges overlapping intervals "
             "given as a list of (start, end) tuples, with a docstring and three example calls."),
    ("code", "Here is a function:\n\n```python\ndef mean(values):\n    total = 0\n    for v in values:\n"
             "        total += v\n    return total / len(values)\n```\n\nRewrite it so that it handles an "
             "empty list, add type hints, and write pytest tests for it."),
    ("summarisation", "Summarise in three sentences: The city council voted on Tuesday to convert two "
                      "downtown parking lots into a public park and a covered market. Supporters argued "
                      "that the lots sit half empty on weekdays and that the market would bring small "
                      "farms closer to residents. Opponents, mostly shop owners, worried that losing "
                      "parking would drive customers to the mall on the edge of town. The council "
                      "promised a new bus line and a parking garage two blocks away before construction "
                      "starts next spring."),
    ("summarisation", "Summarise the following for a busy manager, in bullet points: Our release was "
                      "delayed by a week because the database migration took longer than planned. The "
                      "migration script locked the orders table for eleven minutes in staging, so we "
                      "rewrote it to copy rows in batches. Testing found no data loss. The new search "
                      "feature is done and will ship with the release. Two engineers are out next week, "
                      "so the mobile work moves to the following sprint."),
    ("qa", "Why does ice float on water, and why does that matter for life in lakes during winter?"),
    ("qa", "What is the difference between a process and a thread in an operating system?"),
    ("translation", "Translate into French: The train to Lyon leaves at half past eight from platform "
                    "four. Please keep your ticket until the end of the journey."),
    ("translation", "Translate into German: We are sorry, the museum is closed on Mondays. On all "
                    "other days it opens at ten in the morning and closes at six in the evening."),
    ("math", "A shop sells pencils at 3 for 1.20 dollars and notebooks at 2.50 dollars each. Sara buys "
             "12 pencils and 4 notebooks and pays with a 20 dollar bill. How much change does she get? "
             "Show your steps."),
    ("math", "Solve for x and check your answer: 3(x - 4) + 2x = 5x - 2(x + 3) + 10."),
)
