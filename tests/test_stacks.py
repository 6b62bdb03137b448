"""Parsing faulthandler dumps as the ranks write them."""

import faulthandler
import threading

from distcheck.files.stacks import main_stack, parse_dumps


def test_parses_two_real_dumps_and_finds_main_thread(tmp_path):
    path = tmp_path / "stacks.txt"
    ready, release = threading.Event(), threading.Event()

    def idle_thread():
        ready.set()
        release.wait(10)

    t = threading.Thread(target=idle_thread)
    t.start()
    ready.wait(10)
    with open(path, "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
        faulthandler.dump_traceback(file=f, all_threads=True)
    release.set()
    t.join()
    dumps = parse_dumps(path.read_text())
    assert len(dumps) == 2
    main = main_stack(dumps[0], threading.main_thread().ident)
    assert main is not None and main.ident == threading.main_thread().ident
    assert any(fr.function == "test_parses_two_real_dumps_and_finds_main_thread" for fr in main.frames)
    assert len(dumps[0].threads) >= 2


def test_fatal_header_starts_a_dump():
    text = ("Fatal Python error: Aborted\n\nCurrent thread 0x00007f0000000001 (most recent call first):\n"
            '  File "/x/a.py", line 3 in f\n')
    [dump] = parse_dumps(text)
    assert dump.fatal == "Aborted"
    assert dump.threads[0].frames[0].line == 3
