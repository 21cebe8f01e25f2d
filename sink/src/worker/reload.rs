//! Putting the [`LIVE`](crate::reload::LIVE) settings of a reloaded config in force in the
//! running worker.

use super::*;

impl Worker {
    /// Puts the [`LIVE`] settings of a config reloaded since the last look in force.
    pub(crate) fn take_reload(&mut self) {
        if !self.reloads.has_changed().unwrap_or(false) {
            return;
        }
        let new = self.reloads.borrow_and_update().clone();
        let config = &mut self.config;
        config.rotation = new.rotation.clone();
        config.memory_budget_bytes = new.memory_budget_bytes;
        config.upload.part_bytes = new.upload.part_bytes;
        config.upload.abandoned_after_hours = new.upload.abandoned_after_hours;
        // Partitions stopped at an offset gap go on at the next tick when this is `skip`
        // ([`Worker::resume_gaps`]).
        config.on_offset_gap = new.on_offset_gap;
        let budget = new.upload.staging_budget_bytes;
        if budget != config.upload.staging_budget_bytes {
            // 0 is half the free space: read again now, as at a start.
            match self.staging.budget(budget) {
                Ok(bytes) => {
                    config.upload.staging_budget_bytes = budget;
                    self.staging_budget = bytes;
                }
                Err(e) => tracing::warn!(
                    error = %e,
                    "reload: cannot read the staging directory's free space; the staging budget stays as it was"
                ),
            }
        }
        let targets = self.targets();
        for part in self.parts.values_mut() {
            if let Some(file) = part.file.as_mut() {
                file.set_targets(targets);
            }
        }
        let config = &mut self.config;
        if (new.dedupe_window, new.dedupe_memory_bytes)
            != (config.dedupe_window, config.dedupe_memory_bytes)
        {
            config.dedupe_window = new.dedupe_window;
            config.dedupe_memory_bytes = new.dedupe_memory_bytes;
            let capacity = self.window_capacity(0);
            for part in self.parts.values_mut() {
                part.window.resize_to(capacity);
            }
            self.report_dedupe_memory();
            tracing::info!(
                partitions = self.parts.len(),
                entries_each = capacity,
                "reload: dedupe windows resized"
            );
        }
        tracing::info!(
            rotation = ?self.config.rotation,
            memory_budget_bytes = self.config.memory_budget_bytes,
            staging_budget_bytes = self.staging_budget,
            dedupe_window = self.config.dedupe_window,
            dedupe_memory_bytes = self.config.dedupe_memory_bytes,
            on_offset_gap = self.config.on_offset_gap.as_str(),
            "reloaded settings in force"
        );
    }
}
