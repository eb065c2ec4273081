"""`tessellm bench soak`: a short soak on stories260K — hostile requests answered as stated,
disconnects, ordinary traffic — with its figures every --report-every requests, and the
server idle afterwards."""
from __future__ import annotations

import json

from tessellm.cli.main import main

TEMPLATE = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}assistant:{% endif %}")


def test_a_short_soak_reports_and_leaves_the_server_idle(capsys, stories_dir, tmp_path):
    template = tmp_path / "chat.jinja"
    template.write_text(TEMPLATE)
    assert main(["bench", "soak", "--model", str(stories_dir), "--requests", "300",
                 "--report-every", "100", "--concurrency", "6", "--hostile", "0.2",
                 "--serve-args", f"--dtype float32 --threads 1 --kernel-selection first "
                                 f"--chat-template {template}"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()
             if line.startswith("{")]
    reports = [line for line in lines if "requests" in line]
    assert [r["requests"] for r in reports] == [0, 100, 200, 300, 300]
    final = reports[-1]
    assert final["ok"] and final["unexpected"] == 0 and final["first_unexpected"] == []
    assert final["idle_after"] == {"running": 0.0, "waiting": 0.0, "kv_usage": 0.0}
    assert sum(final["statuses"].values()) == 300 and final["statuses"]["200"] > 150
    assert final["statuses"]["400"] > 0   # the hostile ones
    for r in reports:
        assert r["server_rss_mib"] > 0 and r["core_rss_mib"] > 0 and r["core_fds"] > 0
