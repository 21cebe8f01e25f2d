//! Checking an agent config beyond what serde checks, with the parts of the agent that read each
//! setting (the gateway's HTTP client, the sources' field templates, the MQTT and TLS settings,
//! the filters), so that `edge-agent check` refuses what a run would. Kept apart from `config`,
//! which those parts read: the config's types depend on none of them.

use crate::config::{AgentConfig, SourceConfig};

impl AgentConfig {
    /// Checks what serde cannot; all problems are reported together.
    pub fn validate(&self, streams: &schemas::Streams) -> anyhow::Result<()> {
        let mut problems = Vec::new();
        match (&self.gateway, &self.kafka) {
            (None, None) => problems.push("set an output: [gateway] or [kafka]".to_owned()),
            (Some(_), Some(_)) => {
                problems.push("set only one output: [gateway] or [kafka], not both".to_owned())
            }
            _ => {}
        }
        if let Some(g) = &self.gateway {
            if let Some(bad) = g.retry_statuses.iter().find(|s| !(400..500).contains(*s)) {
                problems.push(format!(
                    "gateway.retry_statuses holds {bad}: only 4xx statuses (5xx are always retried)"
                ));
            }
            if let Err(e) = crate::output::HttpOutput::new(g) {
                problems.push(format!("gateway: {e}"));
            }
        }
        #[cfg(feature = "kafka")]
        if let Some(k) = &self.kafka {
            let mut scratch = rdkafka::ClientConfig::new();
            if let Err(e) =
                service_kit::kafka::security::apply(&mut scratch, k.tls.as_ref(), k.sasl.as_ref())
            {
                problems.push(format!("kafka: {e:#}"));
            }
        }
        #[cfg(not(feature = "kafka"))]
        if self.kafka.is_some() {
            problems.push(crate::output::NO_KAFKA.to_owned());
        }
        if self.sources.is_empty() {
            problems.push("no [[sources]] configured".to_owned());
        }
        for source in &self.sources {
            if let Some(stream) = source.stream()
                && streams.get(stream).is_none()
            {
                problems.push(format!("a source refers to unknown stream '{stream}'"));
            }
            if let Err(e) = source.secret() {
                problems.push(format!("{e:#}"));
            }
            if let (Some(fields), Some(def)) = (
                source.fields(),
                source.stream().and_then(|s| streams.get(s)),
            ) && !fields.is_empty()
                && let Err(e) = crate::source::fields::StaticFields::new(fields, def)
            {
                problems.push(format!("a source of stream '{}': {e}", def.name));
            }
            if let SourceConfig::Http { tls: Some(tls), .. } = source
                && let Err(e) = crate::tls::check_server(tls)
            {
                problems.push(format!("http source: {e:#}"));
            }
            if let SourceConfig::Mqtt {
                qos,
                url,
                tls,
                topic_fields,
                stream,
                ..
            } = source
            {
                if *qos > 1 {
                    problems.push("mqtt qos must be 0 or 1".to_owned());
                }
                if let Err(e) = crate::source::mqtt::check(url, tls) {
                    problems.push(format!("{e:#}"));
                }
                if let (Some(pattern), Some(def)) = (topic_fields, streams.get(stream))
                    && let Err(e) = crate::source::fields::TopicFields::parse(pattern, def)
                {
                    problems.push(format!("mqtt source: {e}"));
                }
            }
        }
        for (name, settings) in &self.streams {
            match streams.get(name) {
                None => problems.push(format!("[streams.{name}] names an unknown stream")),
                Some(def) => {
                    for filter in &settings.filters {
                        if let Err(e) = filter.check(def) {
                            problems.push(format!("[streams.{name}] filter: {e}"));
                        }
                    }
                }
            }
        }
        #[cfg(not(feature = "parquet"))]
        {
            use crate::batch::BodyEncoding;
            let parquet = std::iter::once(Some(self.batch.encoding))
                .chain(self.streams.values().map(|s| s.encoding))
                .any(|e| e == Some(BodyEncoding::Parquet));
            if parquet {
                problems.push("encoding = \"parquet\": this edge-agent is built without Parquet batches (cargo feature `parquet`); use \"ndjson\" or a full build".to_owned());
            }
        }
        if !(1..=22).contains(&self.batch.zstd_level) {
            problems.push("batch.zstd_level must be 1 to 22".to_owned());
        }
        if problems.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("invalid configuration:\n  {}", problems.join("\n  "))
        }
    }
}
