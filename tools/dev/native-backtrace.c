// A preload for locating native crashes on machines without a debugger:
//   cc -shared -fPIC -O1 -o libnative-backtrace.so tools/dev/native-backtrace.c -ldl
//   LD_PRELOAD=$PWD/libnative-backtrace.so python3 ...
// On SIGSEGV / SIGBUS / SIGILL / SIGFPE / SIGABRT it writes the faulting address and every frame as
// "library+offset (nearest exported symbol+offset)" to stderr, then re-raises the signal with the handler that was
// there before (so Python's fault handler, if installed after this, still runs; and the exit status is unchanged).
// Offsets can be turned into source lines on a machine with the same library: addr2line -f -C -e LIB OFFSET.
#define _GNU_SOURCE
#include <dlfcn.h>
#include <execinfo.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <unistd.h>

static char alt_stack[1 << 16];

static void say(char const* text) {
  ssize_t ignored = write(2, text, strlen(text));
  (void)ignored;
}

static void on_fatal(int sig, siginfo_t* info, void* context) {
  (void)context;
  char line[768];
  snprintf(line, sizeof(line), "\n[native-backtrace] pid %d: signal %d (%s) at address %p\n", (int)getpid(), sig,
           strsignal(sig), info ? info->si_addr : NULL);
  say(line);
  void* frames[64];
  int const n = backtrace(frames, 64);
  for (int i = 0; i < n; ++i) {
    Dl_info where;
    memset(&where, 0, sizeof(where));
    if (dladdr(frames[i], &where) && where.dli_fname) {
      snprintf(line, sizeof(line), "[native-backtrace]  #%02d %s+0x%lx (%s+0x%lx)\n", i, where.dli_fname,
               (unsigned long)((char*)frames[i] - (char*)where.dli_fbase), where.dli_sname ? where.dli_sname : "?",
               where.dli_saddr ? (unsigned long)((char*)frames[i] - (char*)where.dli_saddr) : 0UL);
    } else {
      snprintf(line, sizeof(line), "[native-backtrace]  #%02d %p\n", i, frames[i]);
    }
    say(line);
  }
  signal(sig, SIG_DFL);
  raise(sig);
}

__attribute__((constructor)) static void install(void) {
  stack_t stack;
  memset(&stack, 0, sizeof(stack));
  stack.ss_sp = alt_stack;
  stack.ss_size = sizeof(alt_stack);
  sigaltstack(&stack, NULL);
  struct sigaction action;
  memset(&action, 0, sizeof(action));
  action.sa_sigaction = on_fatal;
  action.sa_flags = SA_SIGINFO | SA_ONSTACK;
  sigemptyset(&action.sa_mask);
  int const signals[] = {SIGSEGV, SIGBUS, SIGILL, SIGFPE, SIGABRT};
  for (unsigned i = 0; i < sizeof(signals) / sizeof(signals[0]); ++i) sigaction(signals[i], &action, NULL);
}
