"""A reward written for verl, used as is by the reward-worker run of ``tests/workflow/test_loop.py`` (named by dotted
path)."""


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """verl's signature; the extra numbers say whether each row got its own data source and extra info."""
    digits = solution_str.replace(" ", "")[:4]
    return {"score": float(digits == ground_truth), "source_seen": float(data_source == "toy"),
            "extra_seen": float((extra_info or {}).get("answer") == ground_truth)}
