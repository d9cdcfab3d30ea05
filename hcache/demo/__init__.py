"""``hcache demo``: a scripted multi-turn chat restored by every method (`chat.py`), and its command line."""
