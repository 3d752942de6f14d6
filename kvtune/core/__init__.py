"""Small building blocks every part of kvtune shares (the one registry type, strict JSON)."""
