"""The run machinery every method shares: run folders (safe name, lock), trial store, loop."""
