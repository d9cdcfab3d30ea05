"""Host-side transfers: pinned host buffers and the copies between device and host."""
