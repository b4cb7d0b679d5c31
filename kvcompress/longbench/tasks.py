"""The tasks: LongBench-E's 13 (Table 4's columns), their prompt templates and answer lengths, and the offline suite.

``split_prompt`` cuts a LongBench prompt where kvpress's evaluation does: the context part is compressed,
the question part and the answer prefix (put after the chat template's assistant turn) are not.
"""

from __future__ import annotations

from kvcompress.longbench import metrics, offline_suite

DEFAULT_DATASET = "Xnhyacinth/LongBench"
EXTRA_NEW_TOKENS = 20  # the paper's protocol: LongBench's length + 20

# The 13 LongBench-E tasks in Table 4's column order, with the paper's column names.
LONGBENCH_TASKS: dict[str, str] = {
    "qasper": "qasper",
    "multifieldqa_en": "multifield",
    "hotpotqa": "hotpot",
    "2wikimqa": "2wiki",
    "gov_report": "gov",
    "multi_news": "multinews",
    "trec": "trec",
    "triviaqa": "trivia",
    "samsum": "samsum",
    "passage_count": "p.count",
    "passage_retrieval_en": "p.ret",
    "lcc": "lcc",
    "repobench-p": "repo-p",
}

# LongBench's prompt templates (config/dataset2prompt.json) for those tasks, and the tail of each that
# kvpress's evaluation moves after the chat template's assistant turn (the answer prefix).
PROMPTS: dict[str, str] = {
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, using "
    "a single phrase or sentence if possible. If the question cannot be answered based on the information in the "
    'article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or "unanswerable". '
    "Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on the above article as "
    "concisely as you can, using a single phrase or sentence if possible. If the question cannot be answered based "
    'on the information in the article, write "unanswerable". If the question is a yes/no question, answer "yes", '
    '"no", or "unanswerable". Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:',
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
    "question based on the above text, only give me the answer and do not output any other words.\n\n"
    "Question: {input}\nAnswer:",
    "hotpotqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "2wikimqa": "Answer the question based on the given passages. Only give me the answer and do not output any "
    "other words.\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given "
    "passages. Only give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:",
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
    "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
    "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
    "{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other "
    "words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
    "{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
    "carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. "
    "In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
    "count of unique paragraphs after removing duplicates. The output format should only contain the number, such "
    "as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
    "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the "
    'number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", "Paragraph 2", '
    "etc.\n\nThe answer is: ",
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}
ANSWER_PREFIXES: dict[str, str] = {
    "qasper": "Answer:",
    "multifieldqa_en": "Answer:",
    "hotpotqa": "Answer:",
    "2wikimqa": "Answer:",
    "gov_report": "Summary:",
    "multi_news": "Summary:",
    "trec": "Type:",
    "triviaqa": "Answer:",
    "samsum": "Summary:",
    "passage_count": "The final answer is: ",
    "passage_retrieval_en": "The answer is: ",
    "lcc": "Next line of code:\n",
    "repobench-p": "Next line of code:\n",
}
for _task, _spec in offline_suite.TASKS.items():
    PROMPTS[_task] = _spec.template
    ANSWER_PREFIXES[_task] = _spec.answer_prefix

# Offline tasks: metric functions of kvcompress.longbench.metrics (it scores only the 13 LongBench-E tasks).
OFFLINE_METRICS: dict[str, str] = {task: spec.metric for task, spec in offline_suite.TASKS.items()}
ALL_TASKS: tuple[str, ...] = (*LONGBENCH_TASKS, *offline_suite.TASKS)
COLUMN_NAMES: dict[str, str] = {**LONGBENCH_TASKS, **{t: t for t in offline_suite.TASKS}}
COLUMN_NAMES |= {"niah_single": "niah-s", "niah_multikey": "niah-mk", "niah_multivalue": "niah-mv"}
COLUMN_NAMES |= {"niah_multiquery": "niah-mq", "vt": "vt", "cwe": "cwe", "fwe": "fwe", "qa": "qa"}  # RULER-style
BUCKETS = ("0-4k", "4-8k", "8k+")  # LongBench-E length buckets of the `length` field (words)


def split_prompt(task: str, context: str, question: str) -> tuple[str, str, str]:
    """LongBench's prompt of ``task`` as (compressed context part, question part, answer prefix)."""
    template, prefix = PROMPTS[task], ANSWER_PREFIXES[task]
    head, tail = template.split("{context}")
    tail = tail.replace("{input}", question)  # not str.format: contexts and inputs hold braces (code)
    rest = tail.removesuffix(prefix)  # trec/triviaqa/samsum inputs end with it; kvpress adds it in any case
    lead = len(rest) - len(rest.lstrip("\n"))  # separating newlines stay with the context, as in kvpress
    return head + context + rest[:lead], rest[lead:], prefix


def max_new_tokens(task: str) -> int:
    """The protocol's answer length of ``task``: LongBench's (or the offline task's) + 20; a RULER task's own."""
    from kvcompress.ruler.tasks import TASKS as RULER_TASKS

    if task in RULER_TASKS:  # RULER's own answer lengths, nothing added
        return RULER_TASKS[task].max_new_tokens
    base = metrics.MAX_NEW_TOKENS.get(task)
    if base is None:
        base = offline_suite.TASKS[task].max_new_tokens
    return base + EXTRA_NEW_TOKENS
