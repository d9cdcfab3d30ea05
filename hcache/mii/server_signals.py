"""How ``hcache serve`` drives the OpenAI server process it starts (:mod:`hcache.openai`): the server stands on
the deployment, so the deployment's command owns the contract. Kept light to import: ``hcache serve --help``
reads it without loading either."""
import signal

DRAIN_SIGNAL, READY_SIGNAL = signal.SIGUSR1, signal.SIGUSR2
FINISH_S = 2.0  # after the drain and SIGTERM, the longest a request still running is waited for
