// Ending host waits early. Ferry's host waits for peers (a rank that is late or gone) last up to FERRY_TIMEOUT_S or
// the bootstrap's timeout; a program that wants them to end sooner on a signal of its own (the Python module: Ctrl-C)
// gives the library a check to call while it waits. Ferry installs no signal handler: without a check, a SIGINT ends
// a C++ program as it does any other.
#pragma once

namespace ferry {

// Called about every 100 ms (per waiting thread) from each host wait that can last: the cpu backend's shared-memory
// waits, the cuda backend's synchronisation of an eager call and of check_errors, the socket bootstrap's waits, the
// launcher's wait for its ranks. Runs on the waiting thread; must not call Ferry. Returns true to end the wait: the
// library then throws ferry::Interrupted, after leaving what it waited in as docs/errors.md says (the cpu
// communicator failed, the bootstrap failed, the launcher's ranks ended; on cuda the kernels go on and the next
// synchronisation reports them). Null (the default) turns it off. Thread-safe.
using InterruptCheck = bool (*)();
void set_interrupt_check(InterruptCheck check);

}  // namespace ferry
