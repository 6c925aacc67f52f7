"""Model implementations, the HF checkpoint loader, and random checkpoints for tests and the demo."""
