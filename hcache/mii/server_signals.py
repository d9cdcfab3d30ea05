"""How ``hcache serve`` drives the OpenAI server process it starts (:mod:`hcache.openai`): the server stands on
the deployment, so the deployment's command owns the contract. Kept light to import: ``hcache serve --help``
reads it without loading either."""
import signal

DRAIN_SIGNAL, READY_SIGNAL = signal.SIGUSR1, signal.SIGUSR2
FINISH_S = 2.0  # after the shutdown grace, the longest a request being ended is waited for
# After SIGTERM and the drain, how long requests in flight may take to finish: a 150-token reply at the
# 110 ms a token measured idle on a 2-core CPU (issue 46), within Kubernetes' default 30 s termination
# grace together with the 3 s drain and the deployment's stop.
DEFAULT_SHUTDOWN_GRACE_S = 20.0
