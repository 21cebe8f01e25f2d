//! The agent behind a forward proxy (tinyproxy): delivering through it with Basic credentials,
//! waiting out its 407s without putting batches aside, through its CONNECT tunnel to an HTTPS
//! gateway (in tls.rs), and the proxy the environment names when the config names none.

use crate::support;

use std::time::Duration;

use support::{
    Faults, Proxy, Stub, assert_exactly_once, config, file_source_toml, readings, start,
    wait_landed,
};

/// Without credentials the proxy refuses every batch (a 407, then it drops the connection
/// without reading the body; the answer itself is tested with the stub, in sources.rs): the
/// batches wait in the spool, none is put aside as refused. With credentials (from a password
/// file), everything lands once, and every request went through the proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delivers_through_a_proxy_and_waits_out_its_407s() {
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(dir.path(), Some(("edge", "s3cret"))).await;
    let stub = Stub::start(Faults::default()).await;
    let (lines, expected) = readings(400, 5, 0, 31);
    let input = dir.path().join("r.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let secret = dir.path().join("proxy-password");
    std::fs::write(&secret, "s3cret\n").unwrap();
    let agent = |credentials: &str| {
        config(
            &dir.path().join("state"),
            &stub.url(),
            &format!(
                "[gateway.proxy]\nurl = \"{}\"\n{credentials}[batch]\nmax_records = 100\n",
                proxy.url
            ),
            &file_source_toml(&input, "follow = true\n"),
        )
    };

    let (running, shutdown) = start(&agent(""));
    tokio::time::sleep(Duration::from_secs(4)).await;
    shutdown.cancel();
    let stats = running.await.unwrap().unwrap().total();
    assert!(proxy.posts_to(&stub) > 0, "the agent never asked the proxy");
    assert_eq!(
        stub.landed_total(),
        0,
        "landed without the proxy's credentials"
    );
    assert_eq!(
        stats.delivery.rejected_batches, 0,
        "a 407 put a batch aside"
    );
    let rejected = dir.path().join("state/rejected");
    let kept = std::fs::read_dir(&rejected).map_or(0, |d| d.count());
    assert_eq!(kept, 0, "batches under rejected/");

    let asked = proxy.posts_to(&stub);
    let (running, shutdown) = start(&agent(&format!(
        "username = \"edge\"\npassword_file = {secret:?}\n"
    )));
    wait_landed(&stub, expected.len()).await;
    shutdown.cancel();
    running.await.unwrap().unwrap();
    assert_exactly_once(&stub.landed(), &expected);
    let accepted = stub.recorded.lock().unwrap().accepted.len();
    assert!(
        proxy.posts_to(&stub) >= asked + accepted,
        "{accepted} batches landed, but the proxy saw {} requests after the first run's {asked}",
        proxy.posts_to(&stub)
    );
}

/// Without `[gateway.proxy]` the agent goes through the proxy that `HTTP_PROXY` names;
/// `url = "direct"` ignores it, and so does a configured proxy whose `no_proxy` names the
/// gateway's host (here `HTTP_PROXY` and that proxy name a port where nothing listens).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_environments_proxy_is_used_unless_the_config_says_direct() {
    let dir = tempfile::tempdir().unwrap();
    let proxy = Proxy::start(dir.path(), None).await;
    let (lines, expected) = readings(200, 4, 0, 37);
    let input = dir.path().join("r.ndjson");
    std::fs::write(&input, lines.join("\n") + "\n").unwrap();
    let nowhere = format!("http://127.0.0.1:{}", support::free_port());
    let bypassed = format!("[gateway.proxy]\nurl = \"{nowhere}\"\nno_proxy = \"127.0.0.1\"\n");
    for (run, env_proxy, table) in [
        ("env", &proxy.url, ""),
        ("direct", &nowhere, "[gateway.proxy]\nurl = \"direct\"\n"),
        ("no_proxy", &nowhere, bypassed.as_str()),
    ] {
        let stub = Stub::start(Faults::default()).await;
        let run = dir.path().join(run);
        std::fs::create_dir_all(&run).unwrap();
        let cfg = run.join("agent.toml");
        std::fs::write(
            &cfg,
            config(
                &run.join("state"),
                &stub.url(),
                table,
                &file_source_toml(&input, ""),
            ),
        )
        .unwrap();
        let status = tokio::process::Command::new(env!("CARGO_BIN_EXE_edge-agent"))
            .args(["run", "--config"])
            .arg(&cfg)
            .env("HTTP_PROXY", env_proxy)
            .env_remove("http_proxy")
            .env_remove("ALL_PROXY")
            .env_remove("all_proxy")
            .env_remove("NO_PROXY")
            .env_remove("no_proxy")
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(run.join("agent.log")).unwrap())
            .kill_on_drop(true)
            .status();
        let status = tokio::time::timeout(Duration::from_secs(60), status)
            .await
            .expect("the agent did not finish the file within a minute")
            .unwrap();
        assert!(status.success(), "{table}: {status}");
        assert_exactly_once(&stub.landed(), &expected);
        // Through the dead proxy nothing would have landed.
        if table.is_empty() {
            assert!(proxy.posts_to(&stub) > 0, "HTTP_PROXY was not used");
        }
    }
}
