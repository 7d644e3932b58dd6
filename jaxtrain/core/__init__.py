"""What one optimizer step is, below every loop: the train state and its shardings, the pure step
built around a loss, the task seam, and the language-model task (the first task)."""
