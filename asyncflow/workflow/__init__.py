"""The asynchronous RL workflow: task services, staleness control, the top-level loop."""
