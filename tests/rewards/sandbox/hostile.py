"""Hostile programs: each tries to get out of the jail or take the machine down.

Name → (source, verdicts it may get); ``ANY`` allows every verdict but ``pass`` and
``infra_error`` (the expected output is a string no program prints). This file: writes,
secrets and network; ``hostile_exhaustion.py``: processes and resources. ``@NAME@`` placeholders
are filled by the test with the canaries' paths and ports and the run's process label.

Probes print ``WROTE``, ``CONNECTED``, ``FOUND`` or ``CHANGED`` when they get through; the
tests also check from outside (files, listeners, processes), since a probe's word is the
program's. Probes that touch host-wide state write back what they read, so a broken jail
is detected without harming the test machine.
"""

from __future__ import annotations

from .corpus import CRASH, program
from .hostile_exhaustion import PROCESSES, RESOURCES

ATTEMPT = """
import os, sys
def attempt(path, mode="w"):
    try:
        with open(path, mode) as f:
            f.write("pwned")
        print("WROTE", path)
    except Exception as error:
        print("blocked", path, type(error).__name__)
"""

LEAK = """
import os, sys
def leak(label, fn):
    try:
        print("LEAK", label, repr(fn())[:20000])
    except Exception as error:
        print("blocked", label, type(error).__name__)
"""

CONNECT = """
import socket
def connect(family, kind, address, send=False):
    try:
        s = socket.socket(family, kind)
        s.settimeout(0.5)
        if send:  # a datagram may leave without error; whether it arrived is the listener's count
            s.sendto(b"x", address)
            print("sent", address)
        else:
            s.connect(address)
            print("CONNECTED", address)
    except Exception as error:
        print("blocked", address, type(error).__name__)
"""

WRITES = {
    "write_host_tmp": program("attempt('/tmp/posttrain-pwned')", helper=ATTEMPT),
    "write_home": program(
        """
        attempt('/root/posttrain-pwned')
        attempt(os.path.expanduser('~/posttrain-pwned'))
        """,
        helper=ATTEMPT,
    ),
    "write_repo": program("attempt('@REPO@/posttrain-pwned')", helper=ATTEMPT),
    "write_canary_dir": program("attempt('@CANARY_DIR@/posttrain-pwned')", helper=ATTEMPT),
    "append_canary_file": program("attempt('@CANARY_DIR@/canary.txt', 'a')", helper=ATTEMPT),
    "touch_canary_file": program(
        """
        import os
        path = '@CANARY_DIR@/canary.txt'
        for change in (lambda: os.utime(path, (0, 0)), lambda: os.chmod(path, 0o777), lambda: os.remove(path)):
            try:
                change()
                print('CHANGED')
            except Exception as e:
                print('blocked', e)
        """
    ),
    "write_system_dirs": program(
        """
        for d in ('/etc', '/usr', '/usr/lib', '/var/tmp', '/', '/dev', '/opt', '/work'):
            attempt(d + '/posttrain-pwned')
        """,
        helper=ATTEMPT,
    ),
    "write_interpreter_prefix": program(
        """
        attempt('@PREFIX@/lib/posttrain-pwned')
        try:
            open(os.__file__, 'r+')  # opened for writing, nothing written
            print('WROTE os.py')
        except Exception as e:
            print('blocked', e)
        """,
        helper=ATTEMPT,
    ),
    "write_dev_shm": program("attempt('/dev/shm/posttrain-pwned')", helper=ATTEMPT),
    "symlink_escape": program(
        """
        for target, link in (('/root', '/tmp/r'), ('@CANARY_DIR@', '/tmp/c'), ('/', '/tmp/top')):
            try:
                os.symlink(target, link)
            except Exception as e:
                print(e)
        for path in ('/tmp/r/posttrain-pwned', '/tmp/c/posttrain-pwned', '/tmp/top/posttrain-pwned'):
            attempt(path)
        """,
        helper=ATTEMPT,
    ),
    "proc_root_traversal": program(
        """
        attempt('/proc/1/root/posttrain-pwned')
        attempt('/proc/self/cwd/../posttrain-pwned')
        attempt('/proc/1/cwd/../../../../posttrain-pwned')
        attempt('/proc/self/root/tmp/../posttrain-pwned')
        """,
        helper=ATTEMPT,
    ),
    "mount_over_usr": program(
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print(libc.mount(b'none', b'/usr', b'tmpfs', 0, None), ctypes.get_errno())
        print(libc.mount(None, b'/usr', None, 32 | 4096, None), ctypes.get_errno())  # MS_REMOUNT|MS_BIND, rw
        print(os.system('mount -t tmpfs none /mnt 2>&1'))
        open('/usr/posttrain-pwned', 'w').write('x')
        """
    ),
    "nested_userns_remount": program(
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        print('unshare', libc.unshare(0x10000000 | 0x00020000), ctypes.get_errno())  # NEWUSER|NEWNS
        print('remount', libc.mount(None, b'/usr', None, 32 | 4096, None), ctypes.get_errno())
        print('bind', libc.mount(b'/tmp', b'/usr', None, 4096, None), ctypes.get_errno())
        open('/usr/posttrain-pwned', 'w').write('x')
        open('/root/posttrain-pwned', 'w').write('x')
        """
    ),
    "chroot_escape": program(
        """
        import os
        os.makedirs('/tmp/j', exist_ok=True)
        try:
            os.chroot('/tmp/j')
            for _ in range(50):
                os.chdir('..')
            os.chroot('.')
            open('/posttrain-pwned', 'w').write('x')
        except Exception as e:
            print('blocked', e)
        """
    ),
    "cgroup_and_sysfs": program(
        """
        attempt('/sys/fs/cgroup/pids/cgroup.procs')
        attempt('/sys/fs/cgroup/cgroup.procs')
        """,
        helper=ATTEMPT,
    ),
    # host-wide sysctls that check only the uid (a root trainer's jail is uid 0 in a user namespace)
    "proc_sys_sysctls": program(
        """
        paths = ('/proc/sys/kernel/core_pattern', '/proc/sys/kernel/modprobe', '/proc/sys/vm/drop_caches',
                 '/proc/sys/kernel/hostname', '/proc/sysrq-trigger', '/proc/self/oom_score_adj')
        for path in paths:
            try:
                value = open(path).read() if 'drop_caches' not in path else '0'
                with open(path, 'w') as f:
                    f.write(value)
                print('WROTE', path)
            except Exception as e:
                print('blocked', path, type(e).__name__)
        """
    ),
    "core_dump": program(
        """
        import os
        if os.path.isdir('@CANARY_DIR@'):
            os.chdir('@CANARY_DIR@')
        os.abort()
        """,
        CRASH,
    ),
    "device_nodes": program(
        """
        for device in ('/dev/sda', '/dev/mem', '/dev/kmsg', '/dev/port'):
            attempt(device)
        """,
        helper=ATTEMPT,
    ),
}

SECRETS = {
    "environment": program(
        """
        leak('environ', lambda: dict(os.environ))
        leak('getenv', lambda: os.getenv('@SECRET_ENV@'))
        """,
        helper=LEAK,
    ),
    "proc_environ_all": program(
        """
        for pid in os.listdir('/proc'):
            if pid.isdigit() or pid == 'self':
                leak(pid, lambda: open(f'/proc/{pid}/environ', 'rb').read())
        """,
        helper=LEAK,
    ),
    "home_secret_file": program(
        """
        leak('file', lambda: open('@SECRET_FILE@').read())
        leak('home', lambda: os.listdir('@HOME@'))
        leak('root', lambda: os.listdir('/root'))
        """,
        helper=LEAK,
    ),
    "dataset_file": program("leak('dataset', lambda: open('@DATASET@').read())", helper=LEAK),
    "repo_files": program(
        """
        leak('ls', lambda: os.listdir('@REPO@'))
        leak('pyproject', lambda: open('@REPO@/pyproject.toml').read())
        """,
        helper=LEAK,
    ),
    "proc_cmdline_all": program(
        """
        for pid in os.listdir('/proc'):
            if pid.isdigit():
                leak(pid, lambda: open(f'/proc/{pid}/cmdline', 'rb').read()[-3000:])
        """,
        helper=LEAK,
    ),
    "etc_files": program(
        """
        for f in ('/etc/shadow', '/etc/passwd', '/etc/hostname', '/etc/hosts', '/etc/resolv.conf'):
            leak(f, lambda: open(f).read())
        """,
        helper=LEAK,
    ),
    "filesystem_grep": program(
        """
        import os, time
        start = time.time()
        for root, dirs, files in os.walk('/'):
            dirs[:] = [d for d in dirs if not (root == '/' and d in ('proc', 'sys'))]
            if time.time() - start > 1.2:
                break
            for name in files:
                path = os.path.join(root, name)
                try:
                    data = open(path, 'rb').read(1 << 20)
                except Exception:
                    continue
                if b'canary-secret' in data:
                    print('FOUND', path, data[:200])
        """
    ),
    "parent_memory": program(
        """
        def read_mem(pid):
            out = []
            with open(f'/proc/{pid}/maps') as maps, open(f'/proc/{pid}/mem', 'rb') as mem:
                for line in maps:
                    lo, hi = (int(x, 16) for x in line.split()[0].split('-'))
                    try:
                        mem.seek(lo)
                        out.append(mem.read(min(hi - lo, 1 << 20)))
                    except Exception:
                        pass
            return b''.join(out)[:100]
        leak('init mem', lambda: read_mem(1))
        leak('parent mem', lambda: read_mem(os.getppid()))
        """,
        helper=LEAK,
    ),
    "proc_fds": program(
        """
        leak('fd0', lambda: open('/proc/1/fd/0', 'rb').read())
        leak('links', lambda: [os.readlink(f'/proc/1/fd/{f}') for f in os.listdir('/proc/1/fd')])
        """,
        helper=LEAK,
    ),
    "ptrace_init": program(
        """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        print('attach', libc.ptrace(16, 1, None, None), ctypes.get_errno())
        """
    ),
    "dotfiles": program(
        """
        for f in ('~/.ssh/id_rsa', '~/.bash_history', '~/.gitconfig', '/root/.ssh/id_rsa', '/root/.bashrc'):
            leak(f, lambda: open(os.path.expanduser(f)).read())
        """,
        helper=LEAK,
    ),
    "mountinfo_and_keys": program(
        """
        leak('mountinfo', lambda: open('/proc/self/mountinfo').read())
        leak('keys', lambda: open('/proc/keys').read())
        """,
        helper=LEAK,
    ),
    "host_pids": program(
        """
        import os
        seen = []
        for pid in range(1, 5000):
            try:
                os.kill(pid, 0)
                seen.append(pid)
            except ProcessLookupError:
                pass
            except PermissionError:
                seen.append(pid)
        print('visible', seen)
        """
    ),
}

NETWORK = {
    "tcp_loopback": program("connect(socket.AF_INET, socket.SOCK_STREAM, ('127.0.0.1', @PORT@))", helper=CONNECT),
    "tcp_host_ip": program("connect(socket.AF_INET, socket.SOCK_STREAM, ('@HOST_IP@', @PORT@))", helper=CONNECT),
    "udp_send": program(
        """
        connect(socket.AF_INET, socket.SOCK_DGRAM, ('127.0.0.1', @PORT@), send=True)
        connect(socket.AF_INET, socket.SOCK_DGRAM, ('@HOST_IP@', @PORT@), send=True)
        """,
        helper=CONNECT,
    ),
    "ipv6_loopback": program("connect(socket.AF_INET6, socket.SOCK_STREAM, ('::1', @PORT@))", helper=CONNECT),
    "dns_and_public": program(
        """
        try:
            print('RESOLVED', socket.getaddrinfo('example.com', 80))
        except Exception as e:
            print(e)
        connect(socket.AF_INET, socket.SOCK_STREAM, ('8.8.8.8', 53))
        """,
        helper=CONNECT,
    ),
    "abstract_unix_socket": program("connect(socket.AF_UNIX, socket.SOCK_STREAM, '\\0@ABSTRACT@')", helper=CONNECT),
    "unix_socket_path": program("connect(socket.AF_UNIX, socket.SOCK_STREAM, '@UNIX_PATH@')", helper=CONNECT),
    "raw_socket": program(
        """
        import socket
        try:
            socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
            print('CONNECTED raw')
        except Exception as e:
            print('blocked', e)
        """
    ),
    "urllib_http": program(
        """
        import urllib.request
        try:
            urllib.request.urlopen('http://127.0.0.1:@PORT@/', timeout=1)
            print('CONNECTED')
        except Exception as e:
            print('blocked', e)
        """
    ),
    "broadcast": program(
        """
        s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
            s.sendto(b'x', ('255.255.255.255', @PORT@))
            print('sent broadcast')
        except Exception as e:
            print('blocked', e)
        """,
        helper=CONNECT,
    ),
}

HOSTILE = {**WRITES, **SECRETS, **NETWORK, **PROCESSES, **RESOURCES}
