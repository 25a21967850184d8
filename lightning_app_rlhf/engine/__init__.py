"""One RLHF iteration: its steps, the engine that runs them, experience, batch checks, export."""
