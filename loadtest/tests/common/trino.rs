//! A Trino server of a test's own (`scripts/trino.sh`, installed by `scripts/services.sh
//! install`): its Iceberg connector on one catalog, queried over Trino's HTTP protocol (a
//! statement is posted, then its `nextUri` followed until the last page). A JVM of about 1 GB
//! that takes tens of seconds to start on two cores, so few tests start one.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

/// A running Trino, killed when dropped.
pub struct Trino {
    child: Child,
    port: u16,
    log: std::path::PathBuf,
}

impl Trino {
    /// Starts Trino in `dir` with `catalog` (the Iceberg connector's properties, without
    /// `connector.name`) as its catalog `iceberg`, and waits until it takes queries.
    pub fn start(dir: &Path, catalog: &str) -> Trino {
        let port = super::free_port();
        std::fs::create_dir_all(dir).unwrap();
        let properties = dir.join("iceberg.properties");
        std::fs::write(&properties, format!("connector.name=iceberg\n{catalog}")).unwrap();
        let log = dir.join("trino.log");
        let child = Command::new(super::repo_root().join("scripts/trino.sh"))
            .arg("run")
            .arg(dir)
            .arg(port.to_string())
            .arg(&properties)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("cannot run scripts/trino.sh");
        let mut trino = Trino { child, port, log };
        let deadline = Instant::now() + Duration::from_secs(240);
        loop {
            let text = std::fs::read_to_string(&trino.log).unwrap_or_default();
            if text.contains("SERVER STARTED") {
                return trino;
            }
            if let Ok(Some(status)) = trino.child.try_wait() {
                panic!("Trino exited ({status}): {text}");
            }
            assert!(Instant::now() < deadline, "Trino did not start: {text}");
            std::thread::sleep(Duration::from_millis(500));
        }
    }

    /// The rows of `sql`, each an array of its columns' JSON values; panics with Trino's
    /// message when the query fails. The first query waits until the server has a node to run
    /// queries on (it announces itself a moment after it started).
    pub async fn query(&self, sql: &str) -> Vec<Vec<Value>> {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            match self.try_query(sql).await {
                Ok(rows) => return rows,
                Err(e) if e.contains("No nodes available") && Instant::now() < deadline => {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                }
                Err(e) => panic!("Trino refused {sql}: {e}"),
            }
        }
    }

    async fn try_query(&self, sql: &str) -> Result<Vec<Vec<Value>>, String> {
        let client = reqwest::Client::new();
        let url = format!("http://127.0.0.1:{}/v1/statement", self.port);
        let mut page = page(client.post(url).body(sql.to_owned())).await;
        let mut rows = Vec::new();
        loop {
            if let Some(error) = page.get("error") {
                return Err(error["message"].to_string());
            }
            if let Some(data) = page["data"].as_array() {
                rows.extend(data.iter().map(|r| r.as_array().unwrap().clone()));
            }
            let Some(next) = page["nextUri"].as_str() else {
                return Ok(rows);
            };
            page = self::page(client.get(next)).await;
        }
    }
}

/// One page of a query's results.
async fn page(request: reqwest::RequestBuilder) -> Value {
    request
        .header("X-Trino-User", "edge-ingest-test")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap()
}

impl Drop for Trino {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
