//! Reloading the sink's settings on SIGHUP (`kill -HUP <pid>`, `systemctl reload`).
//!
//! The main binary reads the config file (with the environment's overrides) again and hands it
//! to [`Reload::apply`], which checks it as `sink --check` does. A config that does not load
//! or check changes nothing. One that does is put in force by the running sink at its next
//! tick (within 250 ms), without a restart: a restart uploads every open file, up to
//! `rotation.max_bytes` per partition, so a change of the rotation settings by restart made a
//! round of small files.
//!
//! In force at once ([`LIVE`]): the `[rotation]` settings (open files take the new size
//! targets too, and close at their next check when they are past them), `memory_budget_bytes`,
//! `upload.staging_budget_bytes`, `upload.part_bytes` and `upload.abandoned_after_hours`, and
//! `dedupe_window` and `dedupe_memory_bytes`: every open partition's window is resized to its
//! new share, keeping its newest entries (all of them when it grows; a grown window is not
//! warmed again from the landing files, it fills from the records read after), and
//! `on_offset_gap` (a change to `skip` lets the partitions stopped at a gap go on).
//! The other settings shape what the sink set up when it started (its consumer and group
//! membership, its store client, the keys it writes, its staging folder and admin address):
//! they take effect at the next start, and a reload that changes one of them names it in its
//! log line.

use std::sync::Arc;

use tokio::sync::watch;

use crate::SinkConfig;

/// The settings a reload puts in force in the running sink.
pub const LIVE: &[&str] = &[
    "rotation.max_records",
    "rotation.max_bytes",
    "rotation.row_group_bytes",
    "rotation.idle_ms",
    "rotation.max_age_ms",
    "rotation.max_dead_letter_bytes",
    "memory_budget_bytes",
    "upload.staging_budget_bytes",
    "upload.part_bytes",
    "upload.abandoned_after_hours",
    "dedupe_window",
    "dedupe_memory_bytes",
    "on_offset_gap",
];

/// Hands reloaded configs to a running sink ([`crate::Sink::reload`]).
#[derive(Clone)]
pub struct Reload {
    /// The config the sink started with: what the settings that take a restart still are.
    started: Arc<SinkConfig>,
    sender: Arc<watch::Sender<Arc<SinkConfig>>>,
}

/// What a reload changed.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Reloaded {
    /// Settings of [`LIVE`] whose value changed: in force at the sink's next tick.
    pub in_force: Vec<&'static str>,
    /// Other settings whose value is not the one the sink started with: in force at the next
    /// start.
    pub at_restart: Vec<&'static str>,
}

impl Reload {
    pub(crate) fn new(config: &SinkConfig) -> (Reload, watch::Receiver<Arc<SinkConfig>>) {
        let (sender, receiver) = watch::channel(Arc::new(config.clone()));
        let reload = Reload {
            started: Arc::new(config.clone()),
            sender: Arc::new(sender),
        };
        (reload, receiver)
    }

    /// Checks `config` (its stream definitions loaded and selected, its store and Kafka
    /// security settings, as `sink --check` does) and, if it passes, hands it to the sink.
    pub fn apply(&self, config: SinkConfig) -> anyhow::Result<Reloaded> {
        let streams = service_kit::load_streams_dir(&config.streams_dir)?;
        crate::check(&config, streams)?;
        let running = self.sender.borrow().clone();
        let reloaded = Reloaded {
            in_force: changed(&running, &config, true),
            at_restart: changed(&self.started, &config, false),
        };
        self.sender.send_replace(Arc::new(config));
        Ok(reloaded)
    }
}

/// The settings that differ between `old` and `new`: those of [`LIVE`] if `live`, else the
/// others.
fn changed(old: &SinkConfig, new: &SinkConfig, live: bool) -> Vec<&'static str> {
    let (r, s) = (&old.rotation, &new.rotation);
    let (u, v) = (&old.upload, &new.upload);
    let settings = [
        ("rotation.max_records", r.max_records != s.max_records),
        ("rotation.max_bytes", r.max_bytes != s.max_bytes),
        (
            "rotation.row_group_bytes",
            r.row_group_bytes != s.row_group_bytes,
        ),
        ("rotation.idle_ms", r.idle_ms != s.idle_ms),
        ("rotation.max_age_ms", r.max_age_ms != s.max_age_ms),
        (
            "rotation.max_dead_letter_bytes",
            r.max_dead_letter_bytes != s.max_dead_letter_bytes,
        ),
        (
            "memory_budget_bytes",
            old.memory_budget_bytes != new.memory_budget_bytes,
        ),
        (
            "upload.staging_budget_bytes",
            u.staging_budget_bytes != v.staging_budget_bytes,
        ),
        ("upload.part_bytes", u.part_bytes != v.part_bytes),
        (
            "upload.abandoned_after_hours",
            u.abandoned_after_hours != v.abandoned_after_hours,
        ),
        ("upload.staging_dir", u.staging_dir != v.staging_dir),
        ("streams_dir", old.streams_dir != new.streams_dir),
        ("streams", old.streams != new.streams),
        ("admin_listen", old.admin_listen != new.admin_listen),
        ("kafka", old.kafka != new.kafka),
        ("store", old.store != new.store),
        ("key_prefix", old.key_prefix != new.key_prefix),
        ("landing", old.landing != new.landing),
        ("dedupe_window", old.dedupe_window != new.dedupe_window),
        (
            "dedupe_memory_bytes",
            old.dedupe_memory_bytes != new.dedupe_memory_bytes,
        ),
        ("on_offset_gap", old.on_offset_gap != new.on_offset_gap),
        ("table", old.table != new.table),
    ];
    settings
        .into_iter()
        .filter(|&(name, differs)| differs && LIVE.contains(&name) == live)
        .map(|(name, _)| name)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reload_tells_the_settings_it_puts_in_force_from_those_that_take_a_restart() {
        let old = SinkConfig::default();
        let mut new = old.clone();
        assert_eq!(changed(&old, &new, true), Vec::<&str>::new());
        assert_eq!(changed(&old, &new, false), Vec::<&str>::new());
        new.rotation.max_records = 10;
        new.rotation.idle_ms += 1;
        new.upload.staging_budget_bytes = 1 << 30;
        new.kafka.brokers = "elsewhere:9092".into();
        new.key_prefix = "other".into();
        new.upload.staging_dir = "/elsewhere".into();
        assert_eq!(
            changed(&old, &new, true),
            [
                "rotation.max_records",
                "rotation.idle_ms",
                "upload.staging_budget_bytes"
            ]
        );
        assert_eq!(
            changed(&old, &new, false),
            ["upload.staging_dir", "kafka", "key_prefix"]
        );
    }

    #[test]
    fn every_live_setting_is_compared() {
        // A name in LIVE that `changed` does not list would never be reported.
        let old = SinkConfig::default();
        let mut new = old.clone();
        new.rotation.max_records += 1;
        new.rotation.max_bytes += 1;
        new.rotation.row_group_bytes += 1;
        new.rotation.idle_ms += 1;
        new.rotation.max_age_ms += 1;
        new.rotation.max_dead_letter_bytes += 1;
        new.memory_budget_bytes += 1;
        new.upload.staging_budget_bytes += 1;
        new.upload.part_bytes += 1;
        new.upload.abandoned_after_hours += 1;
        new.dedupe_window += 1;
        new.dedupe_memory_bytes += 1;
        new.on_offset_gap = crate::config::OffsetGapPolicy::Skip;
        assert_eq!(changed(&old, &new, true), LIVE);
        assert_eq!(changed(&old, &new, false), Vec::<&str>::new());
    }
}
