"""DSI's process pool at the end of an answer: the process that owns it exits."""

import subprocess
import sys
import textwrap

from conftest import tiny_llama

EXITS = textwrap.dedent("""
    import atexit, os, sys, time

    import torch

    from specchat.core.speculative.dsi.pool import TargetLoader, process_pool

    pool = process_pool(TargetLoader(sys.argv[1]), ["cpu"], 64)
    pool.submit(torch.arange(300), 300)  # about 5 MB of logits, never read: the pipe fills
    time.sleep(3)
    pool.wake()  # this process's own message, behind them in the same pipe
    pool.close()
    atexit._run_exitfuncs()  # as the CLI ends (app/cli.py)
    print("exited", flush=True)
    os._exit(0)
""")


def test_a_process_exits_with_results_nobody_read_in_the_pipe(tmp_path):
    """A CLI answer printed its JSON, then hung at exit in CI: an instance's result was still in
    the queue's pipe, and this process's feeder thread waited at exit to send a wake-up behind
    it. Hangs until the timeout on the old `close`."""
    tiny_llama(0, vocab_size=4096).hf.save_pretrained(tmp_path)  # loaded in fp32 on the CPU
    completed = subprocess.run([sys.executable, "-c", EXITS, str(tmp_path)], capture_output=True, text=True,
                               timeout=120)
    assert completed.returncode == 0 and completed.stdout.strip() == "exited", completed.stderr
