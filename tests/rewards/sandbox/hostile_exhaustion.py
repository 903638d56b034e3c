"""Hostile programs, second half: fork and thread bombs, daemons, memory, disk, output, time.
See ``hostile.py`` for the format."""

from __future__ import annotations

from .corpus import CRASH, MEMORY, TIMEOUT, program

# programs whose task count only a pids cgroup (or RLIMIT_NPROC, for a non-root trainer) bounds
FORK_BOMBS = {"fork_bomb", "fork_bomb_sleepers", "shell_fork_bomb", "spawn_loop", "zombie_factory"}

PROCESSES = {
    "fork_bomb": program(
        """
        import os
        while True:
            try:
                os.fork()
            except OSError:
                pass
        """
    ),
    "fork_bomb_sleepers": program(
        """
        import os, time
        while True:
            try:
                if os.fork() == 0:
                    time.sleep(100)
            except OSError:
                time.sleep(0.01)
        """
    ),
    "thread_bomb": program(
        """
        import threading, time
        while True:
            try:
                threading.Thread(target=time.sleep, args=(100,), daemon=True).start()
            except Exception:
                pass
        """
    ),
    "multiprocessing_pool": program(
        """
        import multiprocessing as mp
        if __name__ == '__main__':
            with mp.Pool(300) as pool:
                print(pool.map(abs, range(1000)))
        """
    ),
    "double_fork_daemon": program(
        """
        import os
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:
                os.execv('/bin/sh', ['sh', '-c', 'sleep 30', '@LABEL@'])
            os._exit(0)
        print('parent done')
        """
    ),
    "daemon_ignores_signals": program(
        """
        import os, signal, time
        if os.fork() == 0:
            os.setsid()
            for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE):
                signal.signal(s, signal.SIG_IGN)
            time.sleep(100)
        print('parent done')
        """
    ),
    "popen_new_session": program(
        """
        import subprocess
        subprocess.Popen(['/bin/sh', '-c', 'sleep 30', '@LABEL@'], start_new_session=True)
        print('bye')
        """
    ),
    "shell_fork_bomb": program(
        """
        import os
        os.execv('/bin/sh', ['@LABEL@', '-c', 'f() { f | f & }; f'])
        """
    ),
    # kill(-1) only where pid 1 is bwrap: a broken jail must not take the test machine down
    "kill_everything": program(
        """
        import os
        jailed = b'bwrap' in open('/proc/1/cmdline', 'rb').read()
        for pid in (1, 0, -1) if jailed else ():
            try:
                os.kill(pid, 9)
            except Exception as e:
                print(e)
        """
    ),
    "zombie_factory": program(
        """
        import os, time
        end = time.time() + 1
        while time.time() < end:
            try:
                if os.fork() == 0:
                    os._exit(0)
            except OSError:
                pass
        time.sleep(100)
        """,
        TIMEOUT,
    ),
    "spawn_loop": program(
        """
        import os
        while True:
            try:
                os.posix_spawn('/bin/sh', ['@LABEL@', '-c', 'sleep 30'], {})
            except OSError:
                pass
        """
    ),
    "orphan_holds_pipe": program(
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            while True:
                os.write(1, b'.')
                time.sleep(0.05)
        print('parent exits')
        """
    ),
    "setsid_cpu_hogs": program(
        """
        import os
        for _ in range(8):
            if os.fork() == 0:
                os.setsid()
                while True:
                    pass
        print('parent exits')
        """
    ),
    "nested_sandbox_escape": program(
        """
        import os
        print(os.system('unshare -r -p -f --mount-proc sh -c "sleep 30" @LABEL@ 2>&1'))
        """
    ),
}

RESOURCES = {
    "alloc_2gib": program("x = bytearray(2 << 30)\nprint(len(x))", MEMORY),
    # which limit stops it first depends on the host's speed: on a loaded 2-core machine, 64 MiB
    # pages fault in slowly enough for the wall clock to fire first. Either way it is contained.
    "alloc_gradual": program(
        """
        chunks = []
        while True:
            chunks.append(bytearray(64 << 20))
        """,
        MEMORY | TIMEOUT,
    ),
    "mmap_4gib": program("import mmap\nm = mmap.mmap(-1, 4 << 30)\nm[-1] = 1", MEMORY),
    "threads_alloc": program(
        """
        import threading, time
        def eat():
            x = bytearray(16 << 20)
            time.sleep(5)
        threads = [threading.Thread(target=eat) for _ in range(200)]
        for t in threads:
            t.start()
        """,
        {"memory", "crash", "timeout"},
    ),
    "disk_fill_tmp": program(
        """
        total = 0
        try:
            for i in range(10**6):
                with open(f'/tmp/fill{i}', 'wb') as f:
                    for _ in range(8):
                        f.write(b'x' * (1 << 20))
                        total += 1 << 20
        except OSError as e:
            print('stopped at', total, e)
        """
    ),
    "disk_fill_shm": program(
        """
        total = 0
        try:
            for i in range(10**6):
                with open(f'/dev/shm/fill{i}', 'wb') as f:
                    f.write(b'x' * (4 << 20))
                    total += 4 << 20
        except OSError as e:
            print('stopped at', total, e)
        """
    ),
    "big_file": program(
        """
        with open('/tmp/big', 'wb') as f:
            while True:
                f.write(b'x' * (1 << 20))
        """,
        CRASH,
    ),
    "stdout_flood": program("import sys\nwhile True:\n    sys.stdout.write('x' * 65536)", CRASH),
    "stderr_flood": program("import sys\nwhile True:\n    sys.stderr.write('y' * 65536)", CRASH),
    "os_write_flood": program("import os\nchunk = b'z' * (1 << 20)\nwhile True:\n    os.write(1, chunk)", CRASH),
    "busy_loop": program("while True:\n    pass", TIMEOUT),
    "sleep_forever": program("import time\ntime.sleep(10**6)", TIMEOUT),
    "ignore_sigxcpu": program(
        """
        import signal
        signal.signal(signal.SIGXCPU, signal.SIG_IGN)
        while True:
            pass
        """,
        TIMEOUT,
    ),
    "ignore_all_signals": program(
        """
        import signal, time
        for s in signal.Signals:
            try:
                signal.signal(s, signal.SIG_IGN)
            except Exception:
                pass
        time.sleep(10**6)
        """,
        TIMEOUT,
    ),
    "close_pipes_and_spin": program("import os\nos.close(1)\nos.close(2)\nwhile True:\n    pass", TIMEOUT),
    "fd_exhaustion": program(
        """
        import os
        fds = []
        try:
            while True:
                fds.append(os.open('/dev/null', os.O_RDONLY))
        except OSError as e:
            print(len(fds), e)
        """
    ),
    # 3.11 keeps Python frames off the C stack, so this may just run out of time
    "c_stack_overflow": program(
        """
        import sys
        sys.setrecursionlimit(10**8)
        def f(n):
            return f(n + 1) + 1
        f(0)
        """,
        {"crash", "memory", "timeout"},
    ),
    "regex_backtracking": program("import re\nprint(re.match(r'(a+)+$', 'a' * 40 + 'b'))", TIMEOUT),
    "huge_int_to_str": program(
        """
        import sys
        getattr(sys, 'set_int_max_str_digits', int)(0)  # 3.11+: lift the 4300-digit guard
        print(10 ** (10**7))
        """,
        TIMEOUT,
    ),
    "kill_own_group": program("import os\nos.killpg(0, 9)"),
    "stdin_reader_forever": program("import sys, time\nsys.stdin.read()\ntime.sleep(10**6)", TIMEOUT),
}
