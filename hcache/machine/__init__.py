"""This machine and hcache's processes on it: its facts, recorded with every result (``facts``), free ports
(``ports``), process trees ended whole (``process_tree``), and the helper threads kept off the engine's cores
(``helper_threads``). It stands on nothing of hcache but its errors and version."""
